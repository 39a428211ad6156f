//! Links the probe as a kernel driver against the same allowlisted import
//! libraries as kvsrp.sys (made by `kv-sys`).
fn main() {
    println!("cargo::rerun-if-env-changed=KVSRP_IMPORT_LIBS");
    let Ok(dir) = std::env::var("KVSRP_IMPORT_LIBS") else {
        println!("cargo::error=KVSRP_IMPORT_LIBS is not set: build with `kv-sys wine`");
        return;
    };
    println!("cargo::rustc-link-search=native={dir}");
    for lib in ["ntoskrnl", "hal", "cng"] {
        println!("cargo::rustc-link-lib=dylib={lib}");
    }
    for arg in [
        "/DRIVER",
        "/SUBSYSTEM:NATIVE,10.00",
        "/ENTRY:DriverEntry",
        "/NODEFAULTLIB",
        "/DYNAMICBASE",
        "/NXCOMPAT",
        "/OPT:REF,ICF",
        "/MERGE:.rustc=.data",
    ] {
        println!("cargo::rustc-cdylib-link-arg={arg}");
    }
}
