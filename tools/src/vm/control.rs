//! The host side of the command agent on the guest's second serial port.
//!
//! qemu exposes ttyS1 as a unix stream socket. A request is one line,
//! `KVX-RUN <id> <timeout> <base64 command>`; the answer brackets base64
//! stdout and stderr between `KVX-BEGIN <id>`, `KVX-STDERR <id>` and
//! `KVX-END <id> <status>` (see `guest/agent.sh`). Base64 keeps any output
//! byte from being taken for a marker, and the per-request id lets a client
//! skip an answer that was meant for an earlier, abandoned request.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

use super::VmError;

/// Longest command text the agent accepts in one request; the guest tty
/// buffers at most a few KiB while the agent reads.
pub const MAX_COMMAND_LEN: usize = 16 * 1024;
/// Extra time on top of the guest-side limit for the serial round trip.
const TRANSPORT_MARGIN: Duration = Duration::from_secs(15);

/// What a command run in the guest produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    /// Exit status (137 if the guest-side time limit killed it).
    pub status: i32,
    /// Its standard output, byte for byte.
    pub stdout: Vec<u8>,
    /// Its standard error, byte for byte.
    pub stderr: Vec<u8>,
}

impl ExecOutput {
    /// True for exit status 0.
    pub fn success(&self) -> bool {
        self.status == 0
    }

    /// Standard output as text (lossy).
    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    /// Standard error as text (lossy).
    pub fn stderr_text(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }
}

/// One connection to the agent.
pub(crate) struct ControlChannel {
    stream: UnixStream,
    pending: Vec<u8>,
}

static NEXT_REQUEST: AtomicU64 = AtomicU64::new(1);

fn request_id() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "{:x}-{:x}-{}",
        std::process::id(),
        nanos,
        NEXT_REQUEST.fetch_add(1, Ordering::Relaxed)
    )
}

impl ControlChannel {
    /// Connects to qemu's socket for ttyS1.
    pub fn connect(path: &Path) -> Result<Self, VmError> {
        let stream = UnixStream::connect(path).map_err(|e| {
            VmError::io(
                format!("connecting to the control socket {}", path.display()),
                e,
            )
        })?;
        Ok(ControlChannel {
            stream,
            pending: Vec::new(),
        })
    }

    /// Runs `command` with `sh` in the guest, killed there after `limit`.
    pub fn exec(&mut self, command: &str, limit: Duration) -> Result<ExecOutput, VmError> {
        if command.len() > MAX_COMMAND_LEN {
            return Err(VmError::Control(format!(
                "command of {} bytes is longer than the {MAX_COMMAND_LEN} the agent accepts",
                command.len()
            )));
        }
        let secs = limit.as_secs().max(1);
        let id = request_id();
        let request = format!("KVX-RUN {id} {secs} {}\n", STANDARD.encode(command));
        self.stream
            .write_all(request.as_bytes())
            .map_err(|e| VmError::io("writing to the control socket", e))?;
        let deadline = Instant::now() + Duration::from_secs(secs) + TRANSPORT_MARGIN;
        let mut answer = AnswerParser::new(&id);
        loop {
            let line = self.read_line(deadline).map_err(|e| match e {
                LineError::Timeout => VmError::ExecTimeout {
                    command: command.to_owned(),
                    secs,
                },
                LineError::Closed => {
                    VmError::Control("qemu closed the control socket (VM gone?)".to_owned())
                }
                LineError::Io(e) => VmError::io("reading the control socket", e),
            })?;
            if let Some(done) = answer.feed(&line)? {
                return Ok(done);
            }
        }
    }

    fn read_line(&mut self, deadline: Instant) -> Result<String, LineError> {
        loop {
            if let Some(pos) = self.pending.iter().position(|&b| b == b'\n') {
                let rest = self.pending.split_off(pos + 1);
                let line = std::mem::replace(&mut self.pending, rest);
                return Ok(String::from_utf8_lossy(&line)
                    .trim_end_matches(['\r', '\n'])
                    .to_owned());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(LineError::Timeout);
            }
            self.stream
                .set_read_timeout(Some(left))
                .map_err(LineError::Io)?;
            let mut buf = [0u8; 4096];
            match self.stream.read(&mut buf) {
                Ok(0) => return Err(LineError::Closed),
                Ok(n) => self.pending.extend_from_slice(&buf[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(LineError::Io(e)),
            }
        }
    }
}

enum LineError {
    Timeout,
    Closed,
    Io(std::io::Error),
}

/// Assembles the agent's answer for one request id from its lines.
struct AnswerParser {
    begin: String,
    stderr: String,
    end: String,
    state: AnswerState,
    out_b64: String,
    err_b64: String,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum AnswerState {
    WaitingForBegin,
    Stdout,
    Stderr,
}

impl AnswerParser {
    fn new(id: &str) -> Self {
        AnswerParser {
            begin: format!("KVX-BEGIN {id}"),
            stderr: format!("KVX-STDERR {id}"),
            end: format!("KVX-END {id} "),
            state: AnswerState::WaitingForBegin,
            out_b64: String::new(),
            err_b64: String::new(),
        }
    }

    /// Takes one line; returns the answer once its end marker arrived.
    fn feed(&mut self, line: &str) -> Result<Option<ExecOutput>, VmError> {
        match self.state {
            AnswerState::WaitingForBegin => {
                // Anything else is an answer to someone else's request or the
                // agent's greeting.
                if line == self.begin {
                    self.state = AnswerState::Stdout;
                }
            }
            AnswerState::Stdout if line == self.stderr => self.state = AnswerState::Stderr,
            AnswerState::Stdout => self.out_b64.push_str(line.trim()),
            AnswerState::Stderr => {
                if let Some(status) = line.strip_prefix(&self.end) {
                    let status = status
                        .trim()
                        .parse::<i32>()
                        .map_err(|_| VmError::Control(format!("bad exit status in {line:?}")))?;
                    let decode = |b64: &str, what: &str| {
                        STANDARD.decode(b64).map_err(|e| {
                            VmError::Control(format!("undecodable {what} from the agent: {e}"))
                        })
                    };
                    return Ok(Some(ExecOutput {
                        status,
                        stdout: decode(&self.out_b64, "stdout")?,
                        stderr: decode(&self.err_b64, "stderr")?,
                    }));
                }
                self.err_b64.push_str(line.trim());
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed_all(parser: &mut AnswerParser, lines: &[&str]) -> Option<ExecOutput> {
        let mut done = None;
        for line in lines {
            if let Some(out) = parser.feed(line).unwrap() {
                assert!(done.is_none(), "answer completed twice");
                done = Some(out);
            }
        }
        done
    }

    #[test]
    fn answer_is_assembled_and_foreign_answers_skipped() {
        let mut p = AnswerParser::new("7-1-2");
        let out = feed_all(
            &mut p,
            &[
                "KVX-HELLO",
                "KVX-BEGIN 7-1-1", // an abandoned earlier request
                "c3RhbGUK",
                "KVX-STDERR 7-1-1",
                "KVX-END 7-1-1 0",
                "KVX-BEGIN 7-1-2",
                "aGVsbG8g", // "hello " split over two lines
                "d29ybGQK",
                "KVX-STDERR 7-1-2",
                "b29wcwo=",
                "KVX-END 7-1-2 3",
            ],
        )
        .unwrap();
        assert_eq!(out.status, 3);
        assert_eq!(out.stdout_text(), "hello world\n");
        assert_eq!(out.stderr_text(), "oops\n");
        assert!(!out.success());
    }

    #[test]
    fn empty_output_and_bad_answers() {
        let mut p = AnswerParser::new("1");
        let out = feed_all(&mut p, &["KVX-BEGIN 1", "KVX-STDERR 1", "KVX-END 1 0"]).unwrap();
        assert!(out.success() && out.stdout.is_empty() && out.stderr.is_empty());

        let mut p = AnswerParser::new("1");
        p.feed("KVX-BEGIN 1").unwrap();
        p.feed("KVX-STDERR 1").unwrap();
        assert!(matches!(p.feed("KVX-END 1 x"), Err(VmError::Control(_))));

        let mut p = AnswerParser::new("1");
        p.feed("KVX-BEGIN 1").unwrap();
        p.feed("!!!!").unwrap();
        p.feed("KVX-STDERR 1").unwrap();
        assert!(matches!(p.feed("KVX-END 1 0"), Err(VmError::Control(_))));
    }

    #[test]
    fn request_ids_differ() {
        assert_ne!(request_id(), request_id());
    }
}
