//! Stamps `inf/kvsrp.inx` into `kvsrp.inf` as the WDK's `stampinf` would
//! (`$ARCH$` replaced, `DriverVer` set), and optionally writes attached
//! targets into it.

use anyhow::{Result, bail};
use storport_srp::srp::params::{Key, ParamError, parse_add_target};

/// The marker line the target subkeys replace.
pub const TARGETS_MARKER: &str = "; $TARGETS$";

/// The `add_target` keys Linux ib_srp accepts, as the driver's parser
/// (`storport_srp::srp::params`) knows them.
pub fn srp_keys() -> impl Iterator<Item = &'static str> {
    Key::ALL.iter().map(|k| k.name())
}

/// One target to attach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// SRP: an ib_srp `add_target` string.
    Srp {
        /// Subkey name.
        name: String,
        /// The `add_target` string.
        add_target: String,
    },
    /// iSER: IQN and portal.
    Iser {
        /// Subkey name.
        name: String,
        /// Target IQN.
        iqn: String,
        /// `host:port`.
        portal: String,
    },
}

fn check_name(name: &str) -> Result<()> {
    if name.is_empty()
        || name.len() > 64
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        bail!("target name {name:?}: use 1-64 of A-Z a-z 0-9 - _");
    }
    Ok(())
}

fn inf_safe(v: &str) -> Result<()> {
    if v.is_empty()
        || v.chars()
            .any(|c| c == '"' || c == '%' || c.is_control() || !c.is_ascii())
    {
        bail!("value {v:?} cannot be written into an INF string");
    }
    Ok(())
}

/// Parses `NAME=ADD_TARGET` (from `--srp-target`).
///
/// # Errors
/// Malformed name, unknown `add_target` key, or a value an INF cannot hold.
pub fn parse_srp(arg: &str) -> Result<Target> {
    let Some((name, add_target)) = arg.split_once('=') else {
        bail!("--srp-target wants NAME=ADD_TARGET");
    };
    check_name(name)?;
    inf_safe(add_target)?;
    // The driver parses the same string with the same code at find_adapter:
    // what passes here attaches there, byte for byte.
    if let Err(e) = parse_add_target(add_target.as_bytes()) {
        let detail = match e {
            ParamError::UnknownKey { at, len } | ParamError::NotKeyValue { at, len } => {
                format!(" ({:?})", add_target.get(at..at + len).unwrap_or(""))
            }
            _ => String::new(),
        };
        bail!("add_target {add_target:?}: {e}{detail}");
    }
    Ok(Target::Srp {
        name: name.to_owned(),
        add_target: add_target.to_owned(),
    })
}

/// Parses `NAME=IQN@HOST:PORT` (from `--iser-target`).
///
/// # Errors
/// Malformed name, IQN or portal.
pub fn parse_iser(arg: &str) -> Result<Target> {
    let Some((name, rest)) = arg.split_once('=') else {
        bail!("--iser-target wants NAME=IQN@HOST:PORT");
    };
    check_name(name)?;
    let Some((iqn, portal)) = rest.rsplit_once('@') else {
        bail!("--iser-target wants NAME=IQN@HOST:PORT");
    };
    inf_safe(iqn)?;
    inf_safe(portal)?;
    if !(iqn.starts_with("iqn.") || iqn.starts_with("eui.") || iqn.starts_with("naa.")) {
        bail!("{iqn:?} is not an iSCSI name (iqn./eui./naa.)");
    }
    let Some((host, port)) = portal.rsplit_once(':') else {
        bail!("portal {portal:?} wants HOST:PORT");
    };
    if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
        bail!("portal {portal:?} wants HOST:PORT");
    }
    Ok(Target::Iser {
        name: name.to_owned(),
        iqn: iqn.to_owned(),
        portal: portal.to_owned(),
    })
}

/// Stamps the template for `arch` (`amd64`) with `driver_ver`
/// (`MM/DD/YYYY,a.b.c.d`) and the given targets.
///
/// # Errors
/// The template lacks the targets marker or a `DriverVer` line.
pub fn stamp(inx: &str, arch: &str, driver_ver: &str, targets: &[Target]) -> Result<String> {
    if !inx.contains(TARGETS_MARKER) {
        bail!("template has no {TARGETS_MARKER} line");
    }
    let mut out = String::new();
    let mut saw_ver = false;
    for line in inx.lines() {
        if line.trim_start().starts_with("DriverVer") {
            out.push_str(&format!("DriverVer   = {driver_ver}\n"));
            saw_ver = true;
        } else if line.starts_with(TARGETS_MARKER) {
            for t in targets {
                match t {
                    Target::Srp { name, add_target } => {
                        out.push_str(&format!(
                            "HKR, \"Parameters\\Targets\\{name}\", \"Protocol\", 0x00000000, \"srp\"\n\
                             HKR, \"Parameters\\Targets\\{name}\", \"AddTarget\", 0x00000000, \"{add_target}\"\n"
                        ));
                    }
                    Target::Iser { name, iqn, portal } => {
                        out.push_str(&format!(
                            "HKR, \"Parameters\\Targets\\{name}\", \"Protocol\", 0x00000000, \"iser\"\n\
                             HKR, \"Parameters\\Targets\\{name}\", \"TargetName\", 0x00000000, \"{iqn}\"\n\
                             HKR, \"Parameters\\Targets\\{name}\", \"Portal\", 0x00000000, \"{portal}\"\n"
                        ));
                    }
                }
            }
        } else {
            out.push_str(&line.replace("$ARCH$", arch));
            out.push('\n');
        }
    }
    if !saw_ver {
        bail!("template has no DriverVer line");
    }
    // INF files are CRLF text.
    Ok(out.replace('\n', "\r\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SRP: &str = "array1=id_ext=200100e08b000000,ioc_guid=0002c90200402bd4,dgid=fe800000000000000002c90200402bd5,pkey=ffff,service_id=0002c90200402bd4";

    #[test]
    fn stamps_arch_version_and_targets() {
        let inx = include_str!("../../../inf/kvsrp.inx");
        let targets = [
            parse_srp(SRP).unwrap(),
            parse_iser("lio1=iqn.2003-01.org.linux-iscsi.t1:sn.1@192.0.2.10:3260").unwrap(),
        ];
        let inf = stamp(inx, "amd64", "05/01/2025,0.1.0.7", &targets).unwrap();
        assert!(!inf.contains("$ARCH$") && !inf.contains(TARGETS_MARKER));
        assert!(inf.contains("[KvSrp_Models.NTamd64.10.0...16299]\r\n"));
        assert!(inf.contains("DriverVer   = 05/01/2025,0.1.0.7\r\n"));
        assert!(inf.contains(r#"HKR, "Parameters\Targets\array1", "AddTarget", 0x00000000, "id_ext=200100e08b000000,"#));
        assert!(inf.contains(
            r#"HKR, "Parameters\Targets\lio1", "Portal", 0x00000000, "192.0.2.10:3260""#
        ));
        assert!(!inf.replace("\r\n", "").contains('\n'), "CRLF only");
    }

    #[test]
    fn driver_parser_decides() {
        assert!(parse_srp("r=id_ext=1,ioc_guid=2,dest=10.0.0.1:5555,ch_count=2").is_ok());
        let e = parse_srp("r=id_ext=1,ioc_guid=2,dest=10.0.0.1:5555,queue_size=0")
            .unwrap_err()
            .to_string();
        assert!(e.contains("queue_size"), "{e}");
        let e = parse_srp("r=id_ext=1,bogus=2").unwrap_err().to_string();
        assert!(e.contains("bogus"), "{e}");
        assert!(srp_keys().any(|k| k == "tl_retry_count"));
    }

    #[test]
    fn bad_targets_are_refused() {
        for bad in [
            "x",
            "a b=id_ext=1",
            "a=id_ext=1,bogus=2",
            "a=pkey=ffff",
            "a=id_ext=\"1\"",
            "a=id_ext=",
            "a=id_ext=1,ioc_guid=2,dest=10.0.0.1:5555,queue_size=0",
            "a=id_ext=1,ioc_guid=2,dest=10.0.0.1:5555,queue_size=8,queue_size=8",
            "a=id_ext=1,ioc_guid=2,dest=10.0.0.1",
            "a=id_ext=1,ioc_guid=2,dest=10.0.0.1:5555,dgid=fe800000000000000002c90200402bd5",
            "a=id_ext=1,,ioc_guid=2,dest=10.0.0.1:5555",
        ] {
            assert!(parse_srp(bad).is_err(), "{bad}");
        }
        for bad in [
            "a=iqn.x",
            "a=foo@h:3260",
            "a=iqn.x@h",
            "a=iqn.x@h:0",
            "a=iqn.x@:3260",
            "a=iqn.x@h:99999",
        ] {
            assert!(parse_iser(bad).is_err(), "{bad}");
        }
    }
}
