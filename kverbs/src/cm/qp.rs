//! The QP transitions the connection manager drives, and their attributes.
//!
//! A connected QP goes INIT → RTR → RTS. The CM knows the attributes only
//! once the peer has answered, so it asks for each transition as an
//! effect ([`CmEffects::modify_qp`](super::CmEffects::modify_qp)) and
//! continues when it is told the result:
//!
//! * active side, on REP: [`QpModify::ToRtrAndRts`], then RTU;
//! * passive side, on accept: [`QpModify::ToRtr`], then REP; on RTU (or the
//!   first packet: "communication established"): [`QpModify::ToRts`];
//! * either side, on disconnect or a failed setup past INIT:
//!   [`QpModify::ToError`], which flushes every outstanding work request.
//!
//! PSNs follow what Linux does (and what `rdma_rxe` checks): the starting
//! PSN a side advertises in its REQ or REP is the PSN its own receive queue
//! *expects*; each side *sends* from the starting PSN the peer advertised
//! (`ib_send_cm_req` sets `rq_psn` from the REQ; the passive side sends from
//! it). Confirmed on the wire against Linux 6.1 `rdma_rxe`.
//!
//! # IRQL
//!
//! Every function here is pure computation over its arguments (no
//! allocation, no lock, bounded time): callable at any IRQL.

use hca_lowlevel::device::{AccessFlags, AddressVector, Mtu, QpAttr, QpAttrMask, QpState};
use hca_lowlevel::wire::{Psn, Qpn};

use crate::wire::{IbTimeout, PathMtu};

/// INIT → RTR: where to send, what to expect.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct RtrAttrs {
    /// The peer's QP.
    pub dest_qpn: Qpn,
    /// The first PSN the receive queue expects: this side's advertised
    /// starting PSN.
    pub rq_psn: Psn,
    /// The path MTU.
    pub path_mtu: PathMtu,
    /// RDMA READs accepted outstanding (this side's responder resources).
    pub max_dest_rd_atomic: u8,
    /// The RNR NAK timer code the responder advertises.
    pub min_rnr_timer: u8,
    /// The primary path (destination GID, hop limit, traffic class...).
    pub av: AddressVector,
}

/// RTR → RTS: how to send.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct RtsAttrs {
    /// The first PSN sent: the peer's advertised starting PSN.
    pub sq_psn: Psn,
    /// The local ACK timeout (4.096 µs × 2^exponent).
    pub timeout: IbTimeout,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries (the peer's advertised count).
    pub rnr_retry: u8,
    /// RDMA READs issued outstanding (this side's initiator depth).
    pub max_rd_atomic: u8,
}

/// One QP modification the CM asks for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum QpModify {
    /// INIT → RTR (passive side, before REP).
    ToRtr(RtrAttrs),
    /// RTR → RTS (passive side, on RTU or communication established).
    ToRts(RtsAttrs),
    /// INIT → RTR → RTS (active side, before RTU).
    ToRtrAndRts(RtrAttrs, RtsAttrs),
    /// Any state → ERR: flush everything.
    ToError,
}

/// RESET → INIT for a connected QP the CM will drive: `port`, P_Key index
/// 0, and the remote `access` its responder allows. Consumers run it (at
/// `PASSIVE_LEVEL`, with the synchronous modify) before `connect` or
/// `accept`.
pub fn init_attrs(port: u8, access: AccessFlags) -> (QpAttr, QpAttrMask) {
    let attr = QpAttr {
        state: QpState::Init,
        port,
        pkey_index: 0,
        access,
        ..QpAttr::default()
    };
    let mask =
        QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS;
    (attr, mask)
}

/// The hca-lowlevel MTU for a CM path MTU (same codes).
pub fn device_mtu(mtu: PathMtu) -> Mtu {
    match mtu {
        PathMtu::Mtu256 => Mtu::Mtu256,
        PathMtu::Mtu512 => Mtu::Mtu512,
        PathMtu::Mtu1024 => Mtu::Mtu1024,
        PathMtu::Mtu2048 => Mtu::Mtu2048,
        PathMtu::Mtu4096 => Mtu::Mtu4096,
    }
}

impl RtrAttrs {
    /// The attributes and mask of the INIT → RTR modify (exactly the RC
    /// required set: AV, path MTU, destination QPN, RQ PSN, responder
    /// resources, RNR timer).
    pub fn qp_attr(&self) -> (QpAttr, QpAttrMask) {
        let attr = QpAttr {
            state: QpState::Rtr,
            av: self.av,
            path_mtu: device_mtu(self.path_mtu),
            dest_qpn: self.dest_qpn.get(),
            rq_psn: self.rq_psn.get(),
            max_dest_rd_atomic: self.max_dest_rd_atomic,
            min_rnr_timer: self.min_rnr_timer,
            ..QpAttr::default()
        };
        let mask = QpAttrMask::STATE
            | QpAttrMask::AV
            | QpAttrMask::PATH_MTU
            | QpAttrMask::DEST_QPN
            | QpAttrMask::RQ_PSN
            | QpAttrMask::MAX_DEST_RD_ATOMIC
            | QpAttrMask::MIN_RNR_TIMER;
        (attr, mask)
    }
}

impl RtsAttrs {
    /// The attributes and mask of the RTR → RTS modify (exactly the RC
    /// required set: SQ PSN, timeout, retry and RNR retry counts,
    /// initiator depth).
    pub fn qp_attr(&self) -> (QpAttr, QpAttrMask) {
        let attr = QpAttr {
            state: QpState::Rts,
            sq_psn: self.sq_psn.get(),
            timeout: self.timeout.exponent(),
            retry_cnt: self.retry_cnt,
            rnr_retry: self.rnr_retry,
            max_rd_atomic: self.max_rd_atomic,
            ..QpAttr::default()
        };
        let mask = QpAttrMask::STATE
            | QpAttrMask::SQ_PSN
            | QpAttrMask::TIMEOUT
            | QpAttrMask::RETRY_CNT
            | QpAttrMask::RNR_RETRY
            | QpAttrMask::MAX_QP_RD_ATOMIC;
        (attr, mask)
    }
}

impl QpModify {
    /// The device modifies to run, in order (one or two).
    pub fn steps(&self) -> [Option<(QpAttr, QpAttrMask)>; 2] {
        match self {
            QpModify::ToRtr(rtr) => [Some(rtr.qp_attr()), None],
            QpModify::ToRts(rts) => [Some(rts.qp_attr()), None],
            QpModify::ToRtrAndRts(rtr, rts) => [Some(rtr.qp_attr()), Some(rts.qp_attr())],
            QpModify::ToError => [
                Some((
                    QpAttr {
                        state: QpState::Err,
                        ..QpAttr::default()
                    },
                    QpAttrMask::STATE,
                )),
                None,
            ],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hca_lowlevel::device::{QpType, check_modify};
    use hca_lowlevel::wire::Gid;

    fn rtr() -> RtrAttrs {
        RtrAttrs {
            dest_qpn: Qpn::new(0x12).unwrap(),
            rq_psn: Psn::new(0xabcdef).unwrap(),
            path_mtu: PathMtu::Mtu1024,
            max_dest_rd_atomic: 4,
            min_rnr_timer: 12,
            av: AddressVector {
                dgid: Gid([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 2]),
                hop_limit: 64,
                ..AddressVector::default()
            },
        }
    }

    fn rts() -> RtsAttrs {
        RtsAttrs {
            sq_psn: Psn::new(0x123456).unwrap(),
            timeout: IbTimeout::new(19).unwrap(),
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 4,
        }
    }

    // The masks are exactly what the IBA transition table accepts for RC.
    #[test]
    fn masks_pass_the_transition_rules() {
        let (attr, mask) = rtr().qp_attr();
        assert_eq!(
            check_modify(QpType::Rc, QpState::Init, &attr, mask),
            Ok(QpState::Rtr)
        );
        assert_eq!(attr.rq_psn, 0xabcdef);
        assert_eq!(attr.dest_qpn, 0x12);
        assert_eq!(attr.path_mtu, Mtu::Mtu1024);
        let (attr, mask) = rts().qp_attr();
        assert_eq!(
            check_modify(QpType::Rc, QpState::Rtr, &attr, mask),
            Ok(QpState::Rts)
        );
        assert_eq!(attr.sq_psn, 0x123456);
        assert_eq!(attr.timeout, 19);
        let [first, second] = QpModify::ToError.steps();
        let (attr, mask) = first.unwrap();
        assert!(second.is_none());
        assert_eq!(
            check_modify(QpType::Rc, QpState::Rts, &attr, mask),
            Ok(QpState::Err)
        );
        let [a, b] = QpModify::ToRtrAndRts(rtr(), rts()).steps();
        let (attr, mask) = init_attrs(1, AccessFlags::REMOTE_READ);
        assert_eq!(
            check_modify(QpType::Rc, QpState::Reset, &attr, mask),
            Ok(QpState::Init)
        );
        assert_eq!(a.unwrap().0.state, QpState::Rtr);
        assert_eq!(b.unwrap().0.state, QpState::Rts);
    }

    #[test]
    fn mtu_codes_match() {
        for code in 1..=5u8 {
            let mtu = PathMtu::from_code(code).unwrap();
            assert_eq!(device_mtu(mtu) as u8, code);
            assert_eq!(device_mtu(mtu).bytes(), mtu.bytes());
        }
    }
}
