//! How a software SRP target is set up: its logical units, the SRP limits
//! Linux `ib_srpt` exposes as module parameters and configfs attributes,
//! where it listens, whom it lets in.

use std::time::Duration;

use kverbs::cm::CmConfig;
use kverbs::wire::IbTimeout;
use storport_srp::wire::srp::PortId;

use crate::scsi_target::LunConfig;

/// `DEFAULT_MAX_REQ_SIZE` of `ib_srpt`: room for 128 indirect descriptors
/// or 8 KiB of immediate data, whichever is larger (48 + 16 + 20 + 128·16
/// = 2132 vs. 80 + 4 + 8192 = 8276).
pub const DEFAULT_MAX_REQ_SIZE: u32 = 8276;
/// `MIN_MAX_REQ_SIZE` of `ib_srpt`.
pub const MIN_MAX_REQ_SIZE: u32 = 996;
/// The largest `srp_max_req_size` accepted here (one receive buffer each;
/// `ib_srpt` has no upper bound but its allocator's).
pub const MAX_MAX_REQ_SIZE: u32 = 1 << 16;
/// `DEFAULT_MAX_RSP_SIZE` of `ib_srpt`.
pub const DEFAULT_MAX_RSP_SIZE: u32 = 256;
/// The smallest response buffer: an `SRP_RSP` with 4 bytes of response
/// data (`ib_srpt`'s `MIN_MAX_RSP_SIZE`).
pub const MIN_MAX_RSP_SIZE: u32 = 40;
/// The largest response buffer `ib_srpt`'s configfs accepts.
pub const MAX_MAX_RSP_SIZE: u32 = 1024;
/// `MAX_SRPT_RQ_SIZE`: the receive ring (and the credits granted at login).
pub const DEFAULT_RQ_SIZE: u32 = 128;
/// Smallest receive ring accepted.
pub const MIN_RQ_SIZE: u32 = 4;
/// Largest receive ring accepted.
pub const MAX_RQ_SIZE: u32 = 4096;
/// `DEFAULT_MAX_RDMA_SIZE` of `ib_srpt`: bytes per RDMA work request.
pub const DEFAULT_MAX_RDMA_SIZE: u32 = 65536;
/// `MAX_SRPT_RDMA_SIZE` of `ib_srpt`.
pub const MAX_RDMA_SIZE: u32 = 1 << 24;
/// The RDMA/CM port the target listens on unless told otherwise (`ib_srpt`
/// has no default; its `rdma_cm_port` configfs attribute must be set).
pub const DEFAULT_RDMA_CM_PORT: u16 = 5555;
/// Staging memory per channel unless told otherwise.
pub const DEFAULT_STAGING_BYTES: usize = 32 << 20;

/// Where the IB CM listener listens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IbCmListen {
    /// No IB CM listener (RDMA/CM only).
    Off,
    /// On the service GUID, as `ib_srpt` does on an InfiniBand port.
    ServiceGuid,
    /// On this service ID.
    ServiceId(u64),
}

/// An entry of the target's access list. `ib_srpt` names ACLs by the
/// initiator's IP address (RDMA/CM), by its 128-bit port id, or by the GUID
/// half of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InitiatorAcl {
    /// This exact initiator port id.
    PortId(PortId),
    /// Any initiator port id whose GUID half (the port's interface id) is
    /// this.
    Guid(u64),
    /// Logins over RDMA/CM from this IPv4 address.
    Ip([u8; 4]),
}

/// The whole configuration.
#[derive(Debug, Clone)]
pub struct SrpTargetConfig {
    /// The logical units, LUN `i` = `luns[i]`. Each unit's maximum transfer
    /// is lowered to what one channel can stage, so its Block Limits page
    /// tells initiators the truth.
    pub luns: Vec<LunConfig>,
    /// The SCSI target's identity (serial numbers, NAA ids); the service
    /// GUID when `None`.
    pub target_id: Option<u64>,
    /// Largest initiator-to-target IU (`srp_max_req_size`): the receive
    /// buffer size, and `max_it_iu_len` of the login response.
    pub srp_max_req_size: u32,
    /// Largest target-to-initiator IU (`srp_max_rsp_size`): the response
    /// buffer size. Sense is cut to fit it and the initiator's
    /// `max_ti_iu_len`.
    pub srp_max_rsp_size: u32,
    /// Receive ring entries per channel; the credits granted at login.
    pub rq_size: u32,
    /// Most bytes one RDMA READ or WRITE work request moves.
    pub max_rdma_size: u32,
    /// Staging memory per channel (registered buffers the target's RDMA
    /// READs land in and RDMA WRITEs go out from). A command with more data
    /// than this gets CHECK CONDITION, INVALID FIELD IN CDB; commands wait
    /// while the memory is in use by others.
    pub staging_bytes: usize,
    /// The service GUID: both halves of the target port id must be it.
    /// The device's node GUID when `None` (`ib_srpt`'s default).
    pub service_guid: Option<u64>,
    /// RDMA/CM listener port (service `RDMA_PS_TCP << 16 | port`); `None`
    /// for none.
    pub rdma_cm_port: Option<u16>,
    /// The IB CM listener.
    pub ib_cm: IbCmListen,
    /// Initiators allowed in; everyone when `None`.
    pub accepted_initiators: Option<Vec<InitiatorAcl>>,
    /// Grant immediate data when asked (`IMMED_SUPP`).
    pub immediate_data: bool,
    /// READs send their data straight from the RAM disk's chunks (the
    /// stores are registered with the target's PD at start) instead of
    /// copying it into staging memory first.
    pub zero_copy_reads: bool,
    /// Most channels open at once (across all initiators).
    pub max_channels: usize,
    /// RDMA READs outstanding per channel, as offered in the CM REP (the
    /// CM lowers it to the initiator's responder resources). `ib_srpt`: 4.
    pub initiator_depth: u8,
    /// Responder resources offered in the CM REP. `ib_srpt`: 4.
    pub responder_resources: u8,
    /// The target port is enabled (`ib_srpt`'s TPG `enable`).
    pub enabled: bool,
    /// CM timing (`None`: Linux RDMA/CM's).
    pub cm_timing: Option<CmTiming>,
    /// How long [`super::SrpTarget::stop`] waits for each stage.
    pub stop_timeout: Duration,
    /// Serve what can be served in the CQ's DPC (the DPC lane: reads of
    /// up to 64 KiB, immediate-data writes, no-data commands) instead of
    /// waking the channel thread for every command. Off: the thread serves
    /// everything, as before the lane (for comparisons).
    pub serve_in_dpc: bool,
}

/// The CM timing knobs a test may want shorter than Linux's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmTiming {
    /// Packet lifetime.
    pub packet_lifetime: IbTimeout,
    /// Response timeout.
    pub cm_response_timeout: IbTimeout,
    /// Retries.
    pub max_cm_retries: u8,
    /// Timewait.
    pub timewait: IbTimeout,
}

impl Default for SrpTargetConfig {
    fn default() -> Self {
        Self {
            luns: Vec::new(),
            target_id: None,
            srp_max_req_size: DEFAULT_MAX_REQ_SIZE,
            srp_max_rsp_size: DEFAULT_MAX_RSP_SIZE,
            rq_size: DEFAULT_RQ_SIZE,
            max_rdma_size: DEFAULT_MAX_RDMA_SIZE,
            staging_bytes: DEFAULT_STAGING_BYTES,
            service_guid: None,
            rdma_cm_port: Some(DEFAULT_RDMA_CM_PORT),
            ib_cm: IbCmListen::ServiceGuid,
            accepted_initiators: None,
            immediate_data: true,
            zero_copy_reads: true,
            max_channels: 32,
            initiator_depth: 4,
            responder_resources: 4,
            enabled: true,
            cm_timing: None,
            stop_timeout: Duration::from_secs(10),
            serve_in_dpc: true,
        }
    }
}

/// Why a configuration cannot be served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// `srp_max_req_size` outside its range.
    #[error("srp_max_req_size {0} outside {MIN_MAX_REQ_SIZE}..={MAX_MAX_REQ_SIZE}")]
    MaxReqSize(u32),
    /// `srp_max_rsp_size` outside its range.
    #[error("srp_max_rsp_size {0} outside {MIN_MAX_RSP_SIZE}..={MAX_MAX_RSP_SIZE}")]
    MaxRspSize(u32),
    /// `rq_size` outside its range.
    #[error("rq_size {0} outside {MIN_RQ_SIZE}..={MAX_RQ_SIZE}")]
    RqSize(u32),
    /// `max_rdma_size` zero, above `MAX_SRPT_RDMA_SIZE`, or not a multiple
    /// of 4 KiB.
    #[error("max_rdma_size {0} must be a non-zero multiple of 4096 up to {MAX_RDMA_SIZE}")]
    MaxRdmaSize(u32),
    /// Staging memory smaller than one RDMA work request.
    #[error("staging_bytes {0} smaller than max_rdma_size")]
    StagingBytes(usize),
    /// No listener at all.
    #[error("neither an RDMA/CM nor an IB CM listener")]
    NoListener,
    /// `max_channels` zero or above what the CM can track.
    #[error("max_channels {0} outside 1..=4096")]
    MaxChannels(usize),
    /// A logical unit's configuration is invalid.
    #[error("LUN {lun}: {error}")]
    Lun {
        /// Which.
        lun: usize,
        /// Why.
        error: crate::scsi_target::ConfigError,
    },
    /// More logical units than single-level addressing names.
    #[error("{0} logical units; at most {max}", max = crate::scsi_target::MAX_LUNS)]
    TooManyLuns(usize),
}

impl SrpTargetConfig {
    /// A target with `luns` and everything else at `ib_srpt`'s defaults.
    pub fn with_luns(luns: Vec<LunConfig>) -> Self {
        Self {
            luns,
            ..Self::default()
        }
    }

    /// Checks the configuration.
    ///
    /// # Errors
    ///
    /// The first problem found.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(MIN_MAX_REQ_SIZE..=MAX_MAX_REQ_SIZE).contains(&self.srp_max_req_size) {
            return Err(ConfigError::MaxReqSize(self.srp_max_req_size));
        }
        if !(MIN_MAX_RSP_SIZE..=MAX_MAX_RSP_SIZE).contains(&self.srp_max_rsp_size) {
            return Err(ConfigError::MaxRspSize(self.srp_max_rsp_size));
        }
        if !(MIN_RQ_SIZE..=MAX_RQ_SIZE).contains(&self.rq_size) {
            return Err(ConfigError::RqSize(self.rq_size));
        }
        if self.max_rdma_size == 0
            || self.max_rdma_size > MAX_RDMA_SIZE
            || self.max_rdma_size % 4096 != 0
        {
            return Err(ConfigError::MaxRdmaSize(self.max_rdma_size));
        }
        if self.staging_bytes < self.max_rdma_size as usize {
            return Err(ConfigError::StagingBytes(self.staging_bytes));
        }
        if self.rdma_cm_port.is_none() && self.ib_cm == IbCmListen::Off {
            return Err(ConfigError::NoListener);
        }
        if self.max_channels == 0 || self.max_channels > 4096 {
            return Err(ConfigError::MaxChannels(self.max_channels));
        }
        if self.luns.len() > usize::from(crate::scsi_target::MAX_LUNS) {
            return Err(ConfigError::TooManyLuns(self.luns.len()));
        }
        for (lun, cfg) in self.luns.iter().enumerate() {
            cfg.validate()
                .map_err(|error| ConfigError::Lun { lun, error })?;
        }
        Ok(())
    }

    /// The CM engine configuration (tables sized for the channels: every
    /// channel may sit in timewait once more).
    pub(super) fn cm_config(&self) -> CmConfig {
        let mut cm = CmConfig::new(hca_lowlevel::wire::Gid::ZERO, 0);
        if let Some(t) = self.cm_timing {
            cm.packet_lifetime = t.packet_lifetime;
            cm.cm_response_timeout = t.cm_response_timeout;
            cm.max_cm_retries = t.max_cm_retries;
            cm.timewait = t.timewait;
        }
        cm.connections = (self.max_channels * 4).clamp(64, 65535);
        cm.listeners = 4;
        cm
    }

    /// Whether an initiator may log in: its port id, and its IPv4 address
    /// when it came over RDMA/CM.
    pub(super) fn admits(&self, port_id: PortId, ip: Option<[u8; 4]>) -> bool {
        let Some(acl) = &self.accepted_initiators else {
            return true;
        };
        acl.iter().any(|entry| match *entry {
            InitiatorAcl::PortId(id) => id == port_id,
            InitiatorAcl::Guid(guid) => port_id.guid == guid,
            InitiatorAcl::Ip(want) => ip == Some(want),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scsi_target::BlockSize;

    #[test]
    fn defaults_are_srpt_s_and_valid() {
        let c = SrpTargetConfig::default();
        assert_eq!(
            (
                c.srp_max_req_size,
                c.srp_max_rsp_size,
                c.rq_size,
                c.max_rdma_size
            ),
            (8276, 256, 128, 65536)
        );
        assert_eq!((c.initiator_depth, c.responder_resources), (4, 4));
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn every_bad_value_is_named() {
        let bad = |f: fn(&mut SrpTargetConfig)| {
            let mut c = SrpTargetConfig::default();
            f(&mut c);
            c.validate().unwrap_err()
        };
        assert_eq!(
            bad(|c| c.srp_max_req_size = 995),
            ConfigError::MaxReqSize(995)
        );
        assert_eq!(
            bad(|c| c.srp_max_req_size = 1 << 17),
            ConfigError::MaxReqSize(1 << 17)
        );
        assert_eq!(
            bad(|c| c.srp_max_rsp_size = 39),
            ConfigError::MaxRspSize(39)
        );
        assert_eq!(
            bad(|c| c.srp_max_rsp_size = 1025),
            ConfigError::MaxRspSize(1025)
        );
        assert_eq!(bad(|c| c.rq_size = 3), ConfigError::RqSize(3));
        assert_eq!(bad(|c| c.max_rdma_size = 0), ConfigError::MaxRdmaSize(0));
        assert_eq!(
            bad(|c| c.max_rdma_size = 5000),
            ConfigError::MaxRdmaSize(5000)
        );
        assert_eq!(
            bad(|c| c.max_rdma_size = MAX_RDMA_SIZE * 2),
            ConfigError::MaxRdmaSize(MAX_RDMA_SIZE * 2)
        );
        assert_eq!(
            bad(|c| c.staging_bytes = 4096),
            ConfigError::StagingBytes(4096)
        );
        assert_eq!(
            bad(|c| {
                c.rdma_cm_port = None;
                c.ib_cm = IbCmListen::Off;
            }),
            ConfigError::NoListener
        );
        assert_eq!(bad(|c| c.max_channels = 0), ConfigError::MaxChannels(0));
        assert!(matches!(
            bad(|c| c.luns = vec![LunConfig::new(BlockSize::B512, 0)]),
            ConfigError::Lun { lun: 0, .. }
        ));
    }
}
