//! Login: the request the initiator sends and what it accepts back.
//!
//! * [`login_request`] builds `SRP_LOGIN_REQ` as Linux `ib_srp`'s
//!   `srp_send_req` does: tag 0, `req_it_iu_len` from
//!   [`max_it_iu_len`], both descriptor formats (or direct only on the
//!   retry after `UNSUPPORTED_DESCRIPTOR_FMT`), `SINGLE` for a target's
//!   first channel and `MULTI` for the others, immediate data requested at
//!   offset 68 when enabled, and the port identifiers of the target's
//!   `io_class`. [`private_data`] renders it in the form the connection
//!   manager carries: 64 bytes for IB CM, 56 after the RDMA/CM header.
//! * [`accept_login_response`] checks the `SRP_LOGIN_RSP` (REP private
//!   data) against the request and the receive buffers, and returns the
//!   limits the channel then lives by ([`Negotiated`]).
//! * [`interpret_reject`] turns a CM reject into a [`LoginFailure`]; the
//!   SRP reason comes from the `SRP_LOGIN_REJ` in reason-28 private data.
//!
//! # IRQL
//! Pure computation: any IRQL.

#![forbid(unsafe_code)]

use core::fmt;

use kverbs::wire::RejectReason as CmRejectReason;

use super::params::{IoClass, TargetParams};
use crate::wire::srp::{
    self, BufFormats, LoginRej, LoginRejRepr, LoginReq, LoginReqRdma, LoginReqRepr, LoginRsp,
    LoginRspRepr, LoginSolNot, MultiChannelAction, MultiChannelResult, PortId,
    RejectReason as SrpRejectReason, cmd, desc, rsp,
};

/// Additional CDB bytes the engine reserves in every command IU (32-byte
/// CDBs), `SRP_MAX_ADD_CDB_LEN`.
pub const MAX_ADD_CDB_LEN: u32 = 16;
/// Where immediate data starts in an `SRP_CMD`: the command, the
/// additional CDB bytes and the 4-byte immediate descriptor
/// (`SRP_IMM_DATA_OFFSET`).
pub const IMM_DATA_OFFSET: u16 =
    (cmd::LEN as u16) + (MAX_ADD_CDB_LEN as u16) + (desc::IMM_LEN as u16);
static_assertions::const_assert_eq!(IMM_DATA_OFFSET, 68);
/// Linux's default `max_imm_data`.
pub const DEFAULT_MAX_IMM_DATA: u32 = 8 * 1024;
/// The smallest initiator-to-target IU a channel can work with: an
/// `SRP_CMD` with a 16-byte CDB and one direct descriptor.
pub const MIN_USABLE_IT_IU_LEN: u32 = (cmd::LEN + desc::DIRECT_LEN) as u32;
/// The smallest target-to-initiator IU a channel can work with: an
/// `SRP_RSP` header.
pub const MIN_USABLE_TI_IU_LEN: u32 = rsp::LEN as u32;

/// `srp_max_it_iu_len`: the longest IU this initiator sends — a command
/// with the largest CDB and `cmd_sg_entries` inline descriptors, or with
/// `max_imm_data` bytes of immediate data — capped by `max_it_iu_size`.
#[must_use]
pub const fn max_it_iu_len(
    cmd_sg_entries: u8,
    immediate: bool,
    max_imm_data: u32,
    cap: Option<u32>,
) -> u32 {
    let indirect = cmd::LEN as u32
        + MAX_ADD_CDB_LEN
        + desc::INDIRECT_LEN as u32
        + (cmd_sg_entries as u32) * desc::DIRECT_LEN as u32;
    let with_imm = IMM_DATA_OFFSET as u32 + max_imm_data;
    let len = if immediate && with_imm > indirect {
        with_imm
    } else {
        indirect
    };
    match cap {
        Some(c) if c < len => c,
        _ => len,
    }
}

/// The initiator and target port identifiers, in the order the target's
/// `io_class` wants (r16a: extension first; r10: swapped).
#[must_use]
pub const fn port_ids(params: &TargetParams, port_interface_id: u64) -> (PortId, PortId) {
    match params.io_class {
        IoClass::Rev16a => (
            PortId {
                id_ext: params.initiator_ext,
                guid: port_interface_id,
            },
            PortId {
                id_ext: params.id_ext,
                guid: params.ioc_guid,
            },
        ),
        IoClass::Rev10 => (
            PortId {
                id_ext: port_interface_id,
                guid: params.initiator_ext,
            },
            PortId {
                id_ext: params.ioc_guid,
                guid: params.id_ext,
            },
        ),
    }
}

/// What one login asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoginPlan {
    /// `SINGLE` for the first channel, `MULTI` for the others.
    pub multichannel: MultiChannelAction,
    /// Offer direct descriptors only (the retry after the target refused
    /// the formats).
    pub direct_only: bool,
    /// Request immediate data.
    pub immediate: bool,
    /// Longest immediate data the initiator sends.
    pub max_imm_data: u32,
}

/// Builds the login request.
#[must_use]
pub fn login_request(
    params: &TargetParams,
    port_interface_id: u64,
    plan: &LoginPlan,
) -> LoginReqRepr {
    let (initiator_port_id, target_port_id) = port_ids(params, port_interface_id);
    LoginReqRepr {
        tag: 0,
        req_it_iu_len: max_it_iu_len(
            params.cmd_sg_entries,
            plan.immediate,
            plan.max_imm_data,
            params.max_it_iu_size,
        ),
        req_buf_fmt: if plan.direct_only {
            BufFormats::DIRECT
        } else {
            BufFormats::DIRECT | BufFormats::INDIRECT
        },
        multichannel: plan.multichannel,
        sol_not: LoginSolNot::empty(),
        imm_data_offset: plan.immediate.then_some(IMM_DATA_OFFSET),
        initiator_port_id,
        target_port_id,
    }
}

/// Which connection manager carries the login.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoginForm {
    /// The 64-byte `srp_login_req` as IB CM REQ private data.
    IbCm,
    /// The 56-byte `srp_login_req_rdma` after the RDMA/CM header.
    RdmaCm,
}

/// Renders `request` in `form` into `out`; returns the bytes to send.
///
/// # Errors
/// [`srp::Error::BufferTooSmall`] if `out` is shorter than 64 bytes.
pub fn private_data<'a>(
    request: &LoginReqRepr,
    form: LoginForm,
    out: &'a mut [u8; 64],
) -> Result<&'a [u8], srp::Error> {
    match form {
        LoginForm::IbCm => {
            request.emit(&mut LoginReq::new_unchecked(&mut out[..]))?;
            out.get(..request.buffer_len())
                .ok_or(srp::Error::BufferTooSmall)
        }
        LoginForm::RdmaCm => {
            request.emit_rdma(&mut LoginReqRdma::new_unchecked(&mut out[..]))?;
            out.get(..request.rdma_buffer_len())
                .ok_or(srp::Error::BufferTooSmall)
        }
    }
}

/// The limits a channel lives by after its login.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Negotiated {
    /// Initial credits (the request limit).
    pub req_lim: i32,
    /// Longest IU the initiator may send: the smaller of what it asked
    /// and what the target accepts.
    pub max_it_iu_len: u32,
    /// Longest IU the target will send.
    pub max_ti_iu_len: u32,
    /// Descriptor formats both sides use.
    pub formats: BufFormats,
    /// The immediate-data offset, when the target granted it.
    pub immediate: Option<u16>,
    /// What the target did with other channels of this I_T nexus.
    pub multichannel: MultiChannelResult,
}

/// Why a login response was not acceptable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoginError {
    /// The private data is not an `SRP_LOGIN_RSP`.
    Malformed(srp::Error),
    /// The response echoes another tag than the request's.
    TagMismatch,
    /// The target's initiator-to-target IU limit cannot carry a command.
    ItIuTooSmall(u32),
    /// The target's target-to-initiator IU limit cannot carry a response.
    TiIuTooSmall(u32),
    /// The target may send IUs longer than the receive buffers.
    TiIuTooLarge(u32),
    /// No descriptor format both sides support.
    NoCommonFormat,
    /// A negative initial request limit.
    NegativeRequestLimit(i32),
}

impl fmt::Display for LoginError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Malformed(e) => write!(f, "malformed login response: {e}"),
            Self::TagMismatch => f.write_str("login response tag mismatch"),
            Self::ItIuTooSmall(n) => write!(f, "target accepts IUs of {n} bytes only"),
            Self::TiIuTooSmall(n) => write!(f, "target sends IUs of {n} bytes only"),
            Self::TiIuTooLarge(n) => write!(f, "target may send {n}-byte IUs"),
            Self::NoCommonFormat => f.write_str("no common descriptor format"),
            Self::NegativeRequestLimit(n) => write!(f, "negative request limit {n}"),
        }
    }
}

/// Checks a login response (REP private data, zero-padded).
///
/// `rx_len` is the size of the channel's receive buffers: a target that
/// may send longer IUs is refused (its IUs would end the connection with
/// a local length error mid-I/O).
///
/// # Errors
/// [`LoginError`].
pub fn accept_login_response(
    data: &[u8],
    request: &LoginReqRepr,
    rx_len: u32,
) -> Result<Negotiated, LoginError> {
    let rsp = LoginRspRepr::parse(&LoginRsp::new_unchecked(data)).map_err(LoginError::Malformed)?;
    if rsp.tag != request.tag {
        return Err(LoginError::TagMismatch);
    }
    if rsp.req_lim_delta < 0 {
        return Err(LoginError::NegativeRequestLimit(rsp.req_lim_delta));
    }
    if rsp.max_it_iu_len < MIN_USABLE_IT_IU_LEN {
        return Err(LoginError::ItIuTooSmall(rsp.max_it_iu_len));
    }
    if rsp.max_ti_iu_len < MIN_USABLE_TI_IU_LEN {
        return Err(LoginError::TiIuTooSmall(rsp.max_ti_iu_len));
    }
    if rsp.max_ti_iu_len > rx_len {
        return Err(LoginError::TiIuTooLarge(rsp.max_ti_iu_len));
    }
    let formats = rsp.buf_fmt & request.req_buf_fmt;
    if formats.is_empty() {
        return Err(LoginError::NoCommonFormat);
    }
    let max_it_iu_len = rsp.max_it_iu_len.min(request.req_it_iu_len);
    let immediate = match request.imm_data_offset {
        Some(offset) if rsp.immediate_supported && u32::from(offset) < max_it_iu_len => {
            Some(offset)
        }
        _ => None,
    };
    Ok(Negotiated {
        req_lim: rsp.req_lim_delta,
        max_it_iu_len,
        max_ti_iu_len: rsp.max_ti_iu_len,
        formats,
        immediate,
        multichannel: rsp.multichannel,
    })
}

/// Why a login did not produce a channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoginFailure {
    /// The target rejected the login with an `SRP_LOGIN_REJ`.
    Rejected(SrpRejectReason),
    /// The connection manager rejected the request (no listener, stale
    /// connection, bad GID...), with no SRP reason.
    CmRejected(CmRejectReason),
    /// Reason 28 without a readable `SRP_LOGIN_REJ`.
    MalformedReject(srp::Error),
    /// No answer, or the QP could not be brought up.
    Unreachable,
    /// The login response was not acceptable.
    BadResponse(LoginError),
    /// The connection ended before the login completed.
    Disconnected,
    /// The channel's resources could not be created.
    Resources,
}

impl LoginFailure {
    /// A small number for logs and counters.
    #[must_use]
    pub const fn code(self) -> u32 {
        match self {
            Self::Rejected(r) => r.code(),
            Self::CmRejected(r) => r.code() as u32,
            Self::MalformedReject(_) => 0xE001,
            Self::Unreachable => 0xE002,
            Self::BadResponse(_) => 0xE003,
            Self::Disconnected => 0xE004,
            Self::Resources => 0xE005,
        }
    }

    /// Whether to retry at once offering direct descriptors only (the
    /// target refused the formats of a request that offered both).
    #[must_use]
    pub const fn retry_direct_only(self, was_direct_only: bool) -> bool {
        !was_direct_only
            && matches!(
                self,
                Self::Rejected(SrpRejectReason::UnsupportedDescriptorFormat)
            )
    }
}

/// Interprets a CM reject of a login.
#[must_use]
pub fn interpret_reject(reason: CmRejectReason, private_data: &[u8]) -> LoginFailure {
    if reason != CmRejectReason::ConsumerDefined {
        return LoginFailure::CmRejected(reason);
    }
    match LoginRejRepr::parse(&LoginRej::new_unchecked(private_data)) {
        Ok(rej) => LoginFailure::Rejected(rej.reason),
        Err(e) => LoginFailure::MalformedReject(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::srp::params::parse_add_target;

    fn params() -> TargetParams {
        parse_add_target(b"id_ext=1122334455667788,ioc_guid=99aabbccddeeff00,dest=10.0.0.2:5555,initiator_ext=abc").unwrap()
    }

    const PLAN: LoginPlan = LoginPlan {
        multichannel: MultiChannelAction::Single,
        direct_only: false,
        immediate: true,
        max_imm_data: DEFAULT_MAX_IMM_DATA,
    };

    #[test]
    fn iu_lengths_as_linux() {
        // 48 + 16 + 20 + 12 * 16 = 276; with 8 KiB immediate: 68 + 8192.
        assert_eq!(max_it_iu_len(12, false, 8192, None), 276);
        assert_eq!(max_it_iu_len(12, true, 8192, None), 8260);
        assert_eq!(max_it_iu_len(255, false, 0, None), 48 + 16 + 20 + 255 * 16);
        assert_eq!(
            max_it_iu_len(255, true, 1024, None),
            48 + 16 + 20 + 255 * 16
        );
        assert_eq!(max_it_iu_len(12, true, 8192, Some(1000)), 1000);
        assert_eq!(max_it_iu_len(12, true, 8192, Some(9000)), 8260);
    }

    #[test]
    fn request_fields() {
        let p = params();
        let r = login_request(&p, 0x0000_ffff_0a00_0001, &PLAN);
        assert_eq!(r.tag, 0);
        assert_eq!(r.req_it_iu_len, 8260);
        assert_eq!(r.req_buf_fmt, BufFormats::DIRECT | BufFormats::INDIRECT);
        assert_eq!(r.multichannel, MultiChannelAction::Single);
        assert_eq!(r.imm_data_offset, Some(68));
        assert_eq!(
            r.initiator_port_id,
            PortId {
                id_ext: 0xabc,
                guid: 0x0000_ffff_0a00_0001
            }
        );
        assert_eq!(
            r.target_port_id,
            PortId {
                id_ext: 0x1122_3344_5566_7788,
                guid: 0x99aa_bbcc_ddee_ff00
            }
        );
        let r = login_request(
            &p,
            7,
            &LoginPlan {
                multichannel: MultiChannelAction::Multi,
                direct_only: true,
                immediate: false,
                ..PLAN
            },
        );
        assert_eq!(r.req_buf_fmt, BufFormats::DIRECT);
        assert_eq!(r.imm_data_offset, None);
        assert_eq!(r.req_it_iu_len, 276);
        // r10 swaps the halves.
        let p10 = TargetParams {
            io_class: IoClass::Rev10,
            ..p
        };
        let r = login_request(&p10, 7, &PLAN);
        assert_eq!(
            r.initiator_port_id,
            PortId {
                id_ext: 7,
                guid: 0xabc
            }
        );
        assert_eq!(
            r.target_port_id,
            PortId {
                id_ext: 0x99aa_bbcc_ddee_ff00,
                guid: 0x1122_3344_5566_7788
            }
        );
    }

    #[test]
    fn both_forms_parse_back() {
        let r = login_request(&params(), 42, &PLAN);
        let mut buf = [0u8; 64];
        let ib = private_data(&r, LoginForm::IbCm, &mut buf)
            .unwrap()
            .to_vec();
        assert_eq!(ib.len(), 64);
        assert_eq!(ib[0], 0x00);
        assert_eq!(
            LoginReqRepr::parse(&LoginReq::new_unchecked(&ib)).unwrap(),
            r
        );
        let rd = private_data(&r, LoginForm::RdmaCm, &mut buf)
            .unwrap()
            .to_vec();
        assert_eq!(rd.len(), 56);
        assert_eq!(rd[11], 0x00);
        assert_eq!(
            LoginReqRepr::parse_rdma(&LoginReqRdma::new_unchecked(&rd)).unwrap(),
            r
        );
    }

    fn response(f: impl FnOnce(&mut LoginRspRepr)) -> [u8; 96] {
        let mut rsp = LoginRspRepr {
            req_lim_delta: 128,
            tag: 0,
            max_it_iu_len: 8276,
            max_ti_iu_len: 8260,
            buf_fmt: BufFormats::DIRECT | BufFormats::INDIRECT,
            multichannel: MultiChannelResult::NoChannel,
            immediate_supported: true,
        };
        f(&mut rsp);
        let mut out = [0u8; 96];
        rsp.emit(&mut LoginRsp::new_unchecked(&mut out[..]))
            .unwrap();
        out
    }

    #[test]
    fn response_accepted_and_limits_honoured() {
        let req = login_request(&params(), 1, &PLAN);
        let n = accept_login_response(&response(|_| {}), &req, 8260).unwrap();
        assert_eq!(n.req_lim, 128);
        assert_eq!(n.max_it_iu_len, 8260);
        assert_eq!(n.max_ti_iu_len, 8260);
        assert_eq!(n.immediate, Some(68));
        assert_eq!(n.formats, BufFormats::DIRECT | BufFormats::INDIRECT);
        // The target's smaller IU limit wins.
        let n = accept_login_response(&response(|r| r.max_it_iu_len = 300), &req, 8260).unwrap();
        assert_eq!(n.max_it_iu_len, 300);
        // Immediate data only when granted.
        let n = accept_login_response(&response(|r| r.immediate_supported = false), &req, 8260)
            .unwrap();
        assert_eq!(n.immediate, None);
        // ... and only when the offset fits the IU.
        let n = accept_login_response(&response(|r| r.max_it_iu_len = 68), &req, 8260).unwrap();
        assert_eq!(n.immediate, None);
        // Formats intersect.
        let n = accept_login_response(&response(|r| r.buf_fmt = BufFormats::DIRECT), &req, 8260)
            .unwrap();
        assert_eq!(n.formats, BufFormats::DIRECT);
        // Zero credits is legal (credit starvation: CRED_REQ later).
        let n = accept_login_response(&response(|r| r.req_lim_delta = 0), &req, 8260).unwrap();
        assert_eq!(n.req_lim, 0);
        assert_eq!(n.multichannel, MultiChannelResult::NoChannel);
    }

    #[test]
    fn response_errors() {
        let req = login_request(&params(), 1, &PLAN);
        let check = |data: &[u8], want: LoginError| {
            assert_eq!(accept_login_response(data, &req, 8260), Err(want));
        };
        check(&[0u8; 10], LoginError::Malformed(srp::Error::Truncated));
        let mut wrong = response(|_| {});
        wrong[0] = 0xC2;
        check(&wrong, LoginError::Malformed(srp::Error::WrongOpcode(0xC2)));
        check(&response(|r| r.tag = 5), LoginError::TagMismatch);
        check(
            &response(|r| r.req_lim_delta = -1),
            LoginError::NegativeRequestLimit(-1),
        );
        check(
            &response(|r| r.max_it_iu_len = 63),
            LoginError::ItIuTooSmall(63),
        );
        check(
            &response(|r| r.max_ti_iu_len = 35),
            LoginError::TiIuTooSmall(35),
        );
        check(
            &response(|r| r.max_ti_iu_len = 8261),
            LoginError::TiIuTooLarge(8261),
        );
        check(
            &response(|r| r.buf_fmt = BufFormats::empty()),
            LoginError::NoCommonFormat,
        );
        let direct = login_request(
            &params(),
            1,
            &LoginPlan {
                direct_only: true,
                ..PLAN
            },
        );
        assert_eq!(
            accept_login_response(
                &response(|r| r.buf_fmt = BufFormats::INDIRECT),
                &direct,
                8260
            ),
            Err(LoginError::NoCommonFormat)
        );
        for e in [
            LoginError::TagMismatch,
            LoginError::NoCommonFormat,
            LoginError::ItIuTooSmall(1),
        ] {
            assert!(!e.to_string().is_empty());
        }
    }

    #[test]
    fn rejects() {
        let mut rej = [0u8; 148];
        LoginRejRepr {
            reason: SrpRejectReason::UnsupportedDescriptorFormat,
            tag: 0,
            buf_fmt: BufFormats::DIRECT,
        }
        .emit(&mut LoginRej::new_unchecked(&mut rej[..]))
        .unwrap();
        let f = interpret_reject(CmRejectReason::ConsumerDefined, &rej);
        assert_eq!(
            f,
            LoginFailure::Rejected(SrpRejectReason::UnsupportedDescriptorFormat)
        );
        assert!(f.retry_direct_only(false));
        assert!(!f.retry_direct_only(true));
        assert_eq!(
            interpret_reject(CmRejectReason::InvalidServiceId, &rej),
            LoginFailure::CmRejected(CmRejectReason::InvalidServiceId)
        );
        assert!(matches!(
            interpret_reject(CmRejectReason::ConsumerDefined, &[0u8; 4]),
            LoginFailure::MalformedReject(srp::Error::Truncated)
        ));
        let other = interpret_reject(CmRejectReason::ConsumerDefined, &{
            let mut b = [0u8; 32];
            LoginRejRepr {
                reason: SrpRejectReason::ChannelLimitReached,
                tag: 0,
                buf_fmt: BufFormats::empty(),
            }
            .emit(&mut LoginRej::new_unchecked(&mut b[..]))
            .unwrap();
            b
        });
        assert_eq!(other.code(), 0x0001_0006);
        assert!(!other.retry_direct_only(false));
    }
}
