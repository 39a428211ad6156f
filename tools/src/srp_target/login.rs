//! The login, as `ib_srpt`'s `srpt_cm_req_recv` does it: the request read
//! from the CM REQ's private data (RDMA/CM or IB CM form), the checks in
//! `ib_srpt`'s order with its reject reasons, and the response.
//!
//! The checks, in order (wire-formats §1.4):
//!
//! 1. `req_it_iu_len` above `srp_max_req_size` or below 64:
//!    REQ_IT_IU_LENGTH_TOO_LARGE;
//! 2. the target port disabled: INSUFFICIENT_RESOURCES;
//! 3. either half of `target_port_id` not the service GUID:
//!    UNABLE_ASSOCIATE_CHANNEL;
//! 4. the channel's objects cannot be created: INSUFFICIENT_RESOURCES;
//! 5. the initiator not on the access list, or no channel left:
//!    CHANNEL_LIMIT_REACHED;
//! 6. SINGLE: the nexus's other channels are terminated
//!    (`MULTICHAN_TERMINATED` if there were any); MULTI: they stay
//!    (`MULTICHAN_MAINTAINED`).
//!
//! Steps 1–3 and 5 are the pure functions here; the target runs 4 and 6.
//! Like `ib_srpt`, the request's opcode and `req_buf_fmt` are not checked,
//! and any multichannel action other than SINGLE counts as MULTI.

use storport_srp::wire::srp::{
    BufFormats, LoginRej, LoginRejRepr, LoginReq, LoginReqRdma, LoginRsp, LoginRspRepr,
    MultiChannelAction, MultiChannelResult, PortId, RejectReason,
};

use super::config::SrpTargetConfig;

/// `SRP_IMMED_REQUESTED`.
const IMMED_REQUESTED: u8 = 0x80;
/// `SRP_MTCH_ACTION`.
const MTCH_ACTION: u8 = 0x03;
/// The smallest `req_it_iu_len` `ib_srpt` accepts (an `SRP_LOGIN_REQ`).
pub(crate) const MIN_IT_IU_LEN: u32 = 64;
/// The smallest immediate-data offset granted (past the `SRP_CMD` header).
const MIN_IMM_DATA_OFFSET: u16 = 48;

/// Which CM carried the login.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LoginForm {
    /// RDMA/CM: the 56-byte `srp_login_req_rdma` after the CM header.
    RdmaCm,
    /// IB CM: the 64-byte `srp_login_req`.
    IbCm,
}

/// A login request, read as `ib_srpt` reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LoginRequest {
    pub(crate) tag: u64,
    pub(crate) it_iu_len: u32,
    pub(crate) buf_fmt: BufFormats,
    pub(crate) multichannel: MultiChannelAction,
    pub(crate) imm_data_offset: Option<u16>,
    pub(crate) initiator_port_id: PortId,
    pub(crate) target_port_id: PortId,
}

impl LoginRequest {
    /// Reads the request out of the CM private data; `None` if it is too
    /// short to hold one.
    pub(crate) fn parse(form: LoginForm, data: &[u8]) -> Option<Self> {
        let (tag, it_iu_len, buf_fmt, flags, offset, initiator, target) = match form {
            LoginForm::RdmaCm => {
                let v = LoginReqRdma::new_checked(data).ok()?;
                (
                    v.tag(),
                    v.req_it_iu_len(),
                    v.req_buf_fmt(),
                    v.req_flags(),
                    v.imm_data_offset(),
                    v.initiator_port_id(),
                    v.target_port_id(),
                )
            }
            LoginForm::IbCm => {
                let v = LoginReq::new_checked(data).ok()?;
                (
                    v.tag(),
                    v.req_it_iu_len(),
                    v.req_buf_fmt(),
                    v.req_flags(),
                    v.imm_data_offset(),
                    v.initiator_port_id(),
                    v.target_port_id(),
                )
            }
        };
        Some(Self {
            tag,
            it_iu_len,
            buf_fmt,
            multichannel: if flags & MTCH_ACTION == 0 {
                MultiChannelAction::Single
            } else {
                MultiChannelAction::Multi
            },
            imm_data_offset: (flags & IMMED_REQUESTED != 0).then_some(offset),
            initiator_port_id: initiator,
            target_port_id: target,
        })
    }

    /// The I_T nexus this login belongs to.
    pub(crate) fn nexus(&self) -> (PortId, PortId) {
        (self.initiator_port_id, self.target_port_id)
    }
}

/// Checks 1–3.
///
/// # Errors
///
/// The reason to reject with.
pub(crate) fn check_before_resources(
    req: &LoginRequest,
    config: &SrpTargetConfig,
    service_guid: u64,
) -> Result<(), RejectReason> {
    if req.it_iu_len > config.srp_max_req_size || req.it_iu_len < MIN_IT_IU_LEN {
        return Err(RejectReason::ReqItIuLengthTooLarge);
    }
    if !config.enabled {
        return Err(RejectReason::InsufficientResources);
    }
    if req.target_port_id.id_ext != service_guid || req.target_port_id.guid != service_guid {
        return Err(RejectReason::UnableAssociateChannel);
    }
    Ok(())
}

/// Check 5: the access list and the channel limit. `open_channels` counts
/// the channels that stay open (those a SINGLE login terminates excluded).
///
/// # Errors
///
/// CHANNEL_LIMIT_REACHED.
pub(crate) fn check_session(
    req: &LoginRequest,
    config: &SrpTargetConfig,
    peer_ip: Option<[u8; 4]>,
    open_channels: usize,
) -> Result<(), RejectReason> {
    if !config.admits(req.initiator_port_id, peer_ip) || open_channels >= config.max_channels {
        return Err(RejectReason::ChannelLimitReached);
    }
    Ok(())
}

/// The immediate-data offset granted, if any: asked for, allowed, past the
/// `SRP_CMD` header and inside a request.
pub(crate) fn granted_immediate(req: &LoginRequest, config: &SrpTargetConfig) -> Option<u16> {
    let offset = req.imm_data_offset?;
    (config.immediate_data
        && offset >= MIN_IMM_DATA_OFFSET
        && u32::from(offset) < config.srp_max_req_size)
        .then_some(offset)
}

/// The `SRP_LOGIN_RSP` `ib_srpt` sends.
pub(crate) fn login_response(
    req: &LoginRequest,
    config: &SrpTargetConfig,
    multichannel: MultiChannelResult,
    immediate: Option<u16>,
) -> [u8; storport_srp::wire::srp::login_rsp::LEN] {
    let repr = LoginRspRepr {
        req_lim_delta: i32::try_from(config.rq_size).unwrap_or(i32::MAX),
        tag: req.tag,
        max_it_iu_len: config.srp_max_req_size,
        max_ti_iu_len: req.it_iu_len,
        buf_fmt: BufFormats::DIRECT | BufFormats::INDIRECT,
        multichannel,
        immediate_supported: immediate.is_some(),
    };
    let mut buf = [0u8; storport_srp::wire::srp::login_rsp::LEN];
    // The buffer is exactly the IU's length: emit cannot fail.
    let _ = repr.emit(&mut LoginRsp::new_unchecked(&mut buf[..]));
    buf
}

/// The `SRP_LOGIN_REJ` for `reason` (tag 0 when the request was unreadable).
pub(crate) fn login_reject(
    tag: u64,
    reason: RejectReason,
) -> [u8; storport_srp::wire::srp::login_rej::LEN] {
    let repr = LoginRejRepr {
        reason,
        tag,
        buf_fmt: BufFormats::DIRECT | BufFormats::INDIRECT,
    };
    let mut buf = [0u8; storport_srp::wire::srp::login_rej::LEN];
    let _ = repr.emit(&mut LoginRej::new_unchecked(&mut buf[..]));
    buf
}

#[cfg(test)]
mod tests {
    use storport_srp::wire::srp::{LoginReqRepr, LoginRspRepr, LoginSolNot};

    use super::*;

    const GUID: u64 = 0x0200_00ff_fe0a_0002;

    fn request(it_iu_len: u32, multi: MultiChannelAction) -> LoginReqRepr {
        LoginReqRepr {
            tag: 0x1234,
            req_it_iu_len: it_iu_len,
            req_buf_fmt: BufFormats::DIRECT | BufFormats::INDIRECT,
            multichannel: multi,
            sol_not: LoginSolNot::empty(),
            imm_data_offset: Some(68),
            initiator_port_id: PortId {
                id_ext: 7,
                guid: 0xaaaa,
            },
            target_port_id: PortId {
                id_ext: GUID,
                guid: GUID,
            },
        }
    }

    fn rdma_bytes(r: &LoginReqRepr) -> [u8; 56] {
        let mut b = [0u8; 56];
        r.emit_rdma(&mut LoginReqRdma::new_unchecked(&mut b[..]))
            .unwrap();
        b
    }

    #[test]
    fn both_forms_read_the_same_request() {
        let r = request(8260, MultiChannelAction::Multi);
        let rdma = LoginRequest::parse(LoginForm::RdmaCm, &rdma_bytes(&r)).unwrap();
        let mut ib = [0u8; 92];
        r.emit(&mut LoginReq::new_unchecked(&mut ib[..])).unwrap();
        let ib = LoginRequest::parse(LoginForm::IbCm, &ib).unwrap();
        assert_eq!(rdma, ib);
        assert_eq!(rdma.tag, 0x1234);
        assert_eq!(rdma.imm_data_offset, Some(68));
        assert_eq!(rdma.multichannel, MultiChannelAction::Multi);
        assert!(LoginRequest::parse(LoginForm::IbCm, &[0u8; 63]).is_none());
        assert!(LoginRequest::parse(LoginForm::RdmaCm, &[0u8; 55]).is_none());
    }

    #[test]
    fn lenient_like_srpt_opcode_and_reserved_multichannel() {
        let mut b = rdma_bytes(&request(8260, MultiChannelAction::Single));
        b[11] = 0x77; // opcode not checked
        b[10] |= 0x03; // reserved action reads as MULTI
        let r = LoginRequest::parse(LoginForm::RdmaCm, &b).unwrap();
        assert_eq!(r.multichannel, MultiChannelAction::Multi);
    }

    #[test]
    fn checks_in_srpt_order() {
        let config = SrpTargetConfig::default();
        let ok = LoginRequest::parse(
            LoginForm::RdmaCm,
            &rdma_bytes(&request(8260, MultiChannelAction::Single)),
        )
        .unwrap();
        assert_eq!(check_before_resources(&ok, &config, GUID), Ok(()));
        // 1 before 2 before 3: a request that fails all three gets the first.
        let mut bad = ok;
        bad.it_iu_len = config.srp_max_req_size + 1;
        bad.target_port_id.guid = 1;
        let disabled = SrpTargetConfig {
            enabled: false,
            ..config.clone()
        };
        assert_eq!(
            check_before_resources(&bad, &disabled, GUID),
            Err(RejectReason::ReqItIuLengthTooLarge)
        );
        bad.it_iu_len = 63;
        assert_eq!(
            check_before_resources(&bad, &disabled, GUID),
            Err(RejectReason::ReqItIuLengthTooLarge)
        );
        bad.it_iu_len = 64;
        assert_eq!(
            check_before_resources(&bad, &disabled, GUID),
            Err(RejectReason::InsufficientResources)
        );
        assert_eq!(
            check_before_resources(&bad, &config, GUID),
            Err(RejectReason::UnableAssociateChannel)
        );
        bad.target_port_id = PortId {
            id_ext: 1,
            guid: GUID,
        };
        assert_eq!(
            check_before_resources(&bad, &config, GUID),
            Err(RejectReason::UnableAssociateChannel)
        );
        // Exactly srp_max_req_size is fine.
        bad.target_port_id = ok.target_port_id;
        bad.it_iu_len = config.srp_max_req_size;
        assert_eq!(check_before_resources(&bad, &config, GUID), Ok(()));
    }

    #[test]
    fn session_acl_and_channel_limit() {
        use super::super::config::InitiatorAcl;
        let req = LoginRequest::parse(
            LoginForm::RdmaCm,
            &rdma_bytes(&request(8260, MultiChannelAction::Single)),
        )
        .unwrap();
        let open = SrpTargetConfig {
            max_channels: 2,
            ..SrpTargetConfig::default()
        };
        assert_eq!(check_session(&req, &open, None, 1), Ok(()));
        assert_eq!(
            check_session(&req, &open, None, 2),
            Err(RejectReason::ChannelLimitReached)
        );
        for (acl, ip, admitted) in [
            (InitiatorAcl::Guid(0xaaaa), None, true),
            (InitiatorAcl::Guid(0xbbbb), None, false),
            (InitiatorAcl::PortId(req.initiator_port_id), None, true),
            (InitiatorAcl::Ip([10, 0, 0, 1]), Some([10, 0, 0, 1]), true),
            (InitiatorAcl::Ip([10, 0, 0, 1]), Some([10, 0, 0, 9]), false),
            (InitiatorAcl::Ip([10, 0, 0, 1]), None, false),
        ] {
            let config = SrpTargetConfig {
                accepted_initiators: Some(vec![acl]),
                ..SrpTargetConfig::default()
            };
            assert_eq!(
                check_session(&req, &config, ip, 0).is_ok(),
                admitted,
                "{acl:?} {ip:?}"
            );
        }
    }

    #[test]
    fn response_as_srpt_builds_it() {
        let config = SrpTargetConfig::default();
        let req = LoginRequest::parse(
            LoginForm::RdmaCm,
            &rdma_bytes(&request(4200, MultiChannelAction::Single)),
        )
        .unwrap();
        let imm = granted_immediate(&req, &config);
        assert_eq!(imm, Some(68));
        let bytes = login_response(&req, &config, MultiChannelResult::NoChannel, imm);
        let rsp = LoginRspRepr::parse(&LoginRsp::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(rsp.req_lim_delta, 128);
        assert_eq!(rsp.tag, 0x1234);
        assert_eq!(rsp.max_it_iu_len, 8276);
        assert_eq!(rsp.max_ti_iu_len, 4200);
        assert_eq!(rsp.buf_fmt, BufFormats::DIRECT | BufFormats::INDIRECT);
        assert!(rsp.immediate_supported);
        // Immediate data refused when off, or at an offset inside the header.
        let off = SrpTargetConfig {
            immediate_data: false,
            ..SrpTargetConfig::default()
        };
        assert_eq!(granted_immediate(&req, &off), None);
        let mut low = req;
        low.imm_data_offset = Some(47);
        assert_eq!(granted_immediate(&low, &config), None);
        low.imm_data_offset = None;
        assert_eq!(granted_immediate(&low, &config), None);
    }

    #[test]
    fn reject_carries_reason_and_tag() {
        let bytes = login_reject(9, RejectReason::ChannelLimitReached);
        let rej = LoginRejRepr::parse(&LoginRej::new_checked(&bytes[..]).unwrap()).unwrap();
        assert_eq!(rej.reason, RejectReason::ChannelLimitReached);
        assert_eq!(rej.tag, 9);
        assert_eq!(rej.buf_fmt, BufFormats::DIRECT | BufFormats::INDIRECT);
    }
}
