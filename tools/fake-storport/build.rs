//! Links the test double as a kernel-mode DLL named storport.sys; imports
//! come from the same allowlisted import libraries as the driver's.
fn main() {
    println!("cargo::rerun-if-env-changed=KVSRP_IMPORT_LIBS");
    let Ok(dir) = std::env::var("KVSRP_IMPORT_LIBS") else {
        println!("cargo::error=KVSRP_IMPORT_LIBS is not set: build with `kv-sys smoke`");
        return;
    };
    println!("cargo::rustc-link-search=native={dir}");
    println!("cargo::rustc-link-lib=dylib=ntoskrnl");
    for arg in [
        "/SUBSYSTEM:NATIVE,10.00",
        "/NOENTRY",
        "/NODEFAULTLIB",
        "/DYNAMICBASE",
        "/NXCOMPAT",
        "/OPT:REF,ICF",
    ] {
        println!("cargo::rustc-cdylib-link-arg={arg}");
    }
}
