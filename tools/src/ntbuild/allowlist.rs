//! The export allowlists: one `.def` file per kernel module the driver may
//! import from, committed under `storport-srp/driver/imports/`.
//!
//! * `ntoskrnl.def`, `hal.def`: every export of mingw-w64's `libntoskrnl.a`
//!   and `libhal.a` (listed with `llvm-nm`; an `__imp_` symbol without a
//!   code thunk is a DATA export), plus the routines mingw predates, each
//!   with the Microsoft page that documents it ([`NTOSKRNL_EXTRA`]).
//! * `storport.def`: written by hand from the StorPort DDI pages whose
//!   requirements say `Storport.lib` (mingw has no storport import library).
//! * `cng.def`: written by hand; `BCryptGenRandom`, which kernel-mode callers
//!   link from `Cng.lib` (mingw has no kernel CNG import library).
//!
//! The same files make the import libraries the driver links against
//! (`llvm-dlltool`), so a call to anything outside them fails to link, and
//! `kv-sys check` refuses an image importing a name outside them.

use anyhow::{Context, Result, bail};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Where Debian's mingw-w64 keeps the import libraries.
pub const MINGW_LIB: &str = "/usr/x86_64-w64-mingw32/lib";
/// The committed allowlists, relative to the workspace root.
pub const IMPORTS_DIR: &str = "storport-srp/driver/imports";

/// ntoskrnl exports newer than mingw's import library, with their pages.
pub const NTOSKRNL_EXTRA: &[(&str, &str)] = &[
    (
        "ExAllocatePool2",
        "wdm/nf-wdm-exallocatepool2 (Windows 10 2004)",
    ),
    (
        "ExAllocatePool3",
        "wdm/nf-wdm-exallocatepool3 (Windows 10 2004)",
    ),
];

/// The kernel modules and the file each allowlist lives in.
pub const MODULES: &[(&str, &str)] = &[
    ("ntoskrnl.exe", "ntoskrnl.def"),
    ("HAL.dll", "hal.def"),
    ("storport.sys", "storport.def"),
    ("cng.sys", "cng.def"),
];

/// One `.def` file: module name and exports (`true` = DATA).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DefFile {
    /// `LIBRARY` name.
    pub library: String,
    /// Export name -> is DATA.
    pub exports: BTreeMap<String, bool>,
}

/// Parses the subset of `.def` syntax these files use.
///
/// # Errors
/// No `LIBRARY` line.
pub fn parse_def(text: &str) -> Result<DefFile> {
    let mut library = None;
    let mut exports = BTreeMap::new();
    for line in text.lines() {
        let line = line.split(';').next().unwrap_or("").trim();
        if line.is_empty() || line == "EXPORTS" {
            continue;
        }
        if let Some(name) = line.strip_prefix("LIBRARY") {
            library = Some(name.trim().trim_matches('"').to_owned());
            continue;
        }
        let mut words = line.split_whitespace();
        if let Some(name) = words.next() {
            exports.insert(name.to_owned(), words.any(|w| w == "DATA"));
        }
    }
    Ok(DefFile {
        library: library.context("no LIBRARY line")?,
        exports,
    })
}

/// Lists an import library's exports with `llvm-nm`.
fn exports_of_import_lib(lib: &Path) -> Result<BTreeMap<String, bool>> {
    let out = Command::new("llvm-nm")
        .arg(lib)
        .output()
        .context("running llvm-nm (install Debian's llvm)")?;
    if !out.status.success() {
        bail!("llvm-nm {} failed", lib.display());
    }
    let text = String::from_utf8(out.stdout)?;
    let mut imp = BTreeSet::new();
    let mut code = BTreeSet::new();
    for line in text.lines() {
        let mut f = line.split_whitespace();
        let (Some(_), Some(kind), Some(sym)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        match (kind, sym.strip_prefix("__imp_")) {
            ("I", Some(name)) => {
                imp.insert(name.to_owned());
            }
            ("T", None) => {
                code.insert(sym.to_owned());
            }
            _ => {}
        }
    }
    Ok(imp
        .into_iter()
        .map(|n| {
            let data = !code.contains(&n);
            (n, data)
        })
        .collect())
}

fn render(library: &str, header: &str, exports: &BTreeMap<String, bool>) -> String {
    let mut s = String::new();
    for line in header.lines() {
        s.push_str("; ");
        s.push_str(line);
        s.push('\n');
    }
    s.push_str(&format!("LIBRARY \"{library}\"\nEXPORTS\n"));
    for (name, data) in exports {
        s.push_str(name);
        if *data {
            s.push_str(" DATA");
        }
        s.push('\n');
    }
    s
}

/// Regenerates (or with `check`, verifies) `ntoskrnl.def` and `hal.def`.
///
/// # Errors
/// Tools missing, or (`check`) a committed file differs.
pub fn run(root: &Path, check: bool) -> Result<()> {
    let lib = Path::new(MINGW_LIB);
    let mut nt = exports_of_import_lib(&lib.join("libntoskrnl.a"))?;
    let mut extra_lines = String::new();
    for (name, page) in NTOSKRNL_EXTRA {
        nt.insert((*name).to_owned(), false);
        extra_lines.push_str(&format!("{name}: {page}\n"));
    }
    let hal = exports_of_import_lib(&lib.join("libhal.a"))?;
    let files = [
        (
            "ntoskrnl.def",
            render(
                "ntoskrnl.exe",
                &format!(
                    "@generated by `kv-sys allowlist`: the exports of Debian mingw-w64's\n\
                     libntoskrnl.a, plus routines newer than it (page in MicrosoftDocs\n\
                     windows-driver-docs-ddi):\n{extra_lines}"
                ),
                &nt,
            ),
        ),
        (
            "hal.def",
            render(
                "HAL.dll",
                "@generated by `kv-sys allowlist`: the exports of Debian mingw-w64's libhal.a.",
                &hal,
            ),
        ),
    ];
    for (file, text) in files {
        let path = root.join(IMPORTS_DIR).join(file);
        if check {
            let committed = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            if committed != text {
                bail!("{} is stale: run `kv-sys allowlist`", path.display());
            }
        } else {
            std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        }
    }
    Ok(())
}

/// Makes `<name>.lib` import libraries from the allowlists into `out`.
///
/// # Errors
/// `llvm-dlltool` missing or failing.
pub fn make_import_libs(root: &Path, out: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(out)?;
    for (_, def) in MODULES {
        let stem = def.trim_end_matches(".def");
        let status = Command::new("llvm-dlltool")
            .args(["-m", "i386:x86-64", "-d"])
            .arg(root.join(IMPORTS_DIR).join(def))
            .arg("-l")
            .arg(out.join(format!("{stem}.lib")))
            .status()
            .context("running llvm-dlltool (install Debian's llvm)")?;
        if !status.success() {
            bail!("llvm-dlltool failed for {def}");
        }
    }
    Ok(out.to_path_buf())
}

/// Loads every allowlist: module (lower case) -> its `.def`.
///
/// # Errors
/// A file is missing or malformed.
pub fn load(root: &Path) -> Result<BTreeMap<String, DefFile>> {
    let mut all = BTreeMap::new();
    for (module, def) in MODULES {
        let path = root.join(IMPORTS_DIR).join(def);
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let parsed = parse_def(&text).with_context(|| format!("parsing {}", path.display()))?;
        if !parsed.library.eq_ignore_ascii_case(module) {
            bail!(
                "{} names LIBRARY {}, expected {module}",
                path.display(),
                parsed.library
            );
        }
        all.insert(module.to_ascii_lowercase(), parsed);
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn def_files_parse_with_comments_and_data() {
        let d = parse_def("; hi\nLIBRARY \"HAL.dll\"\nEXPORTS\nKeStallExecutionProcessor ; x\nHalDispatchTable DATA\n")
            .unwrap();
        assert_eq!(d.library, "HAL.dll");
        assert_eq!(d.exports.get("KeStallExecutionProcessor"), Some(&false));
        assert_eq!(d.exports.get("HalDispatchTable"), Some(&true));
        assert!(parse_def("EXPORTS\nX\n").is_err());
    }

    #[test]
    fn committed_allowlists_load_and_name_the_routines_the_shim_uses() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let all = load(&root).unwrap();
        let nt = &all["ntoskrnl.exe"].exports;
        for name in [
            "KeBugCheckEx",
            "ExFreePoolWithTag",
            "MmGetSystemRoutineAddress",
            "ExAllocatePool2",
            "memset",
        ] {
            assert_eq!(nt.get(name), Some(&false), "{name}");
        }
        let sp = &all["storport.sys"].exports;
        for name in [
            "StorPortInitialize",
            "StorPortNotification",
            "StorPortExtendedFunction",
        ] {
            assert!(sp.contains_key(name), "{name}");
        }
        assert!(
            !sp.contains_key("StorPortEnablePassiveInitialization"),
            "an inline, not an export"
        );
    }
}
