//! The NT driver build-and-check command.
fn main() -> anyhow::Result<()> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let check = std::env::args().any(|a| a == "--check");
    let out = kverbs_tools::ntbuild::bindings::run(
        &root,
        std::path::Path::new(kverbs_tools::ntbuild::bindings::MINGW_INCLUDE),
        check,
    )?;
    println!("{}", out.display());
    Ok(())
}
