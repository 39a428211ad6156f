//! Links the driver as a kernel image. The import libraries for
//! ntoskrnl.exe, HAL.dll, storport.sys and cng.sys are made by `kv-sys` from the
//! committed export allowlists in `imports/` (so a call to anything not in
//! them fails to link) and passed in `KVSRP_IMPORT_LIBS`.

fn main() {
    println!("cargo::rerun-if-env-changed=KVSRP_IMPORT_LIBS");
    println!("cargo::rerun-if-changed=imports");
    let target = std::env::var("TARGET").unwrap_or_default();
    if !target.contains("windows-msvc") {
        println!("cargo::error=kvsrp is a Windows kernel driver: build it with `kv-sys build`");
        return;
    }
    match std::env::var("KVSRP_IMPORT_LIBS") {
        Ok(dir) => {
            println!("cargo::rustc-link-search=native={dir}");
            for lib in ["ntoskrnl", "hal", "storport", "cng"] {
                println!("cargo::rustc-link-lib=dylib={lib}");
            }
        }
        Err(_) => println!(
            "cargo::error=KVSRP_IMPORT_LIBS is not set: build with `cargo run -p kverbs-tools --bin kv-sys -- build`"
        ),
    }
    // The kernel-image switches windows-drivers-rs passes for a WDM driver
    // (wdk-build), as lld-link spells them; the PE checksum is written by
    // kv-sys because lld-link computes none.
    for arg in [
        "/DRIVER",
        "/SUBSYSTEM:NATIVE,10.00",
        "/ENTRY:DriverEntry",
        "/NODEFAULTLIB",
        "/DYNAMICBASE",
        "/NXCOMPAT",
        "/INTEGRITYCHECK",
        "/OPT:REF,ICF",
        "/MERGE:.rustc=.data",
        "/MANIFEST:NO",
        "/MAP",
    ] {
        println!("cargo::rustc-cdylib-link-arg={arg}");
    }
}
