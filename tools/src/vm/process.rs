//! Host commands with a time limit and their output kept for error messages.

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use wait_timeout::ChildExt;

use super::VmError;

/// What a finished command left behind.
#[derive(Debug)]
pub(crate) struct Finished {
    pub success: bool,
    pub status: String,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

impl Finished {
    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    /// The last lines of stdout and stderr together, for an error message.
    pub fn output_tail(&self) -> String {
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&self.stdout),
            String::from_utf8_lossy(&self.stderr)
        );
        let lines: Vec<&str> = text.lines().collect();
        let start = lines.len().saturating_sub(20);
        lines[start..]
            .iter()
            .map(|l| format!("  | {l}\n"))
            .collect()
    }
}

/// The command line as a person would type it.
pub(crate) fn describe(cmd: &Command) -> String {
    let mut parts = vec![cmd.get_program().to_string_lossy().into_owned()];
    parts.extend(cmd.get_args().map(|a| a.to_string_lossy().into_owned()));
    parts.join(" ")
}

/// Runs `cmd` to completion within `limit`, feeding it `stdin` and collecting
/// (or, with `stdout_to`, redirecting) its output. Kills it on time-out.
pub(crate) fn run_with(
    cmd: &mut Command,
    limit: Duration,
    stdin: Option<&[u8]>,
    stdout_to: Option<&Path>,
) -> Result<Finished, VmError> {
    let what = describe(cmd);
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    match stdout_to {
        Some(path) => {
            let file = std::fs::File::create(path)
                .map_err(|e| VmError::io(format!("creating {}", path.display()), e))?;
            cmd.stdout(file);
        }
        None => {
            cmd.stdout(Stdio::piped());
        }
    }
    cmd.stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .map_err(|e| VmError::io(format!("starting `{what}`"), e))?;
    let writer = match (stdin, child.stdin.take()) {
        (Some(data), Some(mut pipe)) => {
            let data = data.to_vec();
            Some(std::thread::spawn(move || {
                // A command that exits early closes the pipe; that is its business.
                let _ = pipe.write_all(&data);
            }))
        }
        _ => None,
    };
    let read_all = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut buf);
            }
            buf
        })
    };
    let out_reader = read_all(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let err_reader = read_all(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let status = match child
        .wait_timeout(limit)
        .map_err(|e| VmError::io(format!("waiting for `{what}`"), e))?
    {
        Some(status) => status,
        None => {
            let _ = child.kill();
            let _ = child.wait();
            return Err(VmError::CommandTimeout {
                command: what,
                secs: limit.as_secs(),
            });
        }
    };
    if let Some(w) = writer {
        let _ = w.join();
    }
    let stdout = out_reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();
    Ok(Finished {
        success: status.success(),
        status: status.to_string(),
        stdout,
        stderr,
    })
}

/// Runs `cmd` and fails with its output unless it exits with status 0.
pub(crate) fn run_ok(cmd: &mut Command, limit: Duration) -> Result<Finished, VmError> {
    let finished = run_with(cmd, limit, None, None)?;
    check(cmd, finished)
}

/// Turns an unsuccessful [`Finished`] into [`VmError::CommandFailed`].
pub(crate) fn check(cmd: &Command, finished: Finished) -> Result<Finished, VmError> {
    if finished.success {
        Ok(finished)
    } else {
        Err(VmError::CommandFailed {
            command: describe(cmd),
            status: finished.status.clone(),
            output: finished.output_tail(),
        })
    }
}

/// Finds an executable on `$PATH` or in the system directories that a
/// non-root `$PATH` often lacks (`depmod` and `modprobe` live in `/sbin`).
pub(crate) fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let extra = [
        "/usr/local/sbin",
        "/usr/local/bin",
        "/usr/sbin",
        "/usr/bin",
        "/sbin",
        "/bin",
    ];
    std::env::split_paths(&path)
        .chain(extra.iter().map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// A `Command` for a program found by [`find_program`], or a clear error
/// naming the Debian package that provides it.
pub(crate) fn program(name: &str, package: &str) -> Result<Command, VmError> {
    find_program(name)
        .map(Command::new)
        .ok_or_else(|| VmError::PackagesMissing {
            missing: vec![package.to_owned()],
            reason: format!("`{name}` was not found on PATH or in /sbin, /usr/sbin"),
        })
}

/// True when running as root (needed for apt-get install).
pub(crate) fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// True if a process with this pid exists and its command line mentions
/// `needle` (so a recycled pid is never mistaken for our qemu).
pub(crate) fn process_matches(pid: u32, needle: &OsStr) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let needle = needle.as_encoded_bytes();
    !needle.is_empty() && cmdline.windows(needle.len()).any(|w| w == needle)
}

/// Sends `signal` to `pid`.
pub(crate) fn signal(pid: u32, signal: libc::c_int) -> std::io::Result<()> {
    let pid = libc::pid_t::try_from(pid)
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: kill(2) on a positive pid has no memory-safety preconditions.
    if unsafe { libc::kill(pid, signal) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_collects_output_and_status() {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "cat; echo out; echo err >&2; exit 3"]);
        let f = run_with(&mut cmd, Duration::from_secs(10), Some(b"in\n"), None).unwrap();
        assert!(!f.success);
        assert_eq!(f.stdout_text(), "in\nout\n");
        assert_eq!(f.stderr, b"err\n");
        match check(&cmd, f) {
            Err(VmError::CommandFailed {
                command, output, ..
            }) => {
                assert!(command.starts_with("sh -c"));
                assert!(output.contains("| err"));
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn run_kills_on_timeout() {
        let mut cmd = Command::new("sleep");
        cmd.arg("30");
        let start = std::time::Instant::now();
        match run_with(&mut cmd, Duration::from_millis(200), None, None) {
            Err(VmError::CommandTimeout { command, .. }) => assert_eq!(command, "sleep 30"),
            other => panic!("unexpected {other:?}"),
        }
        assert!(start.elapsed() < Duration::from_secs(20));
    }

    #[test]
    fn find_program_searches_sbin_too() {
        assert!(find_program("sh").is_some());
        assert!(find_program("surely-not-a-program-kv-vm").is_none());
        match program("surely-not-a-program-kv-vm", "some-package") {
            Err(VmError::PackagesMissing { missing, .. }) => {
                assert_eq!(missing, vec!["some-package"])
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn process_matches_checks_the_command_line() {
        let me = std::process::id();
        assert!(process_matches(me, OsStr::new("vm")) || process_matches(me, OsStr::new("kverbs")));
        assert!(!process_matches(
            me,
            OsStr::new("no-such-needle-in-cmdline-xyz")
        ));
        assert!(!process_matches(u32::MAX, OsStr::new("x")));
    }
}
