//! Login Request (0x03, always immediate) and Login Response (0x23).
//!
//! The login moves through stages (security negotiation, operational
//! negotiation, full feature phase); each PDU names its current stage and,
//! with the Transit bit, the next one. The Continue bit says the text
//! `key=value` data goes on in the next PDU.

use super::serial::SerialNumber;
use super::{Error, Opcode, Result, expect_opcode, start_emit};

mod field {
    use crate::wire::Field;

    pub const VERSION_MAX: Field = 2..3;
    pub const VERSION_MIN: Field = 3..4;
    pub const ISID: Field = 8..14;
    pub const TSIH: Field = 14..16;
    pub const ITT: Field = 16..20;
    pub const CID: Field = 20..22;
    pub const CMD_SN: Field = 24..28;
    pub const EXP_STAT_SN: Field = 28..32;

    // Response.
    pub const VERSION_ACTIVE: Field = 3..4;
    pub const STAT_SN: Field = 24..28;
    pub const EXP_CMD_SN: Field = 28..32;
    pub const MAX_CMD_SN: Field = 32..36;
    pub const STATUS_CLASS: Field = 36..37;
    pub const STATUS_DETAIL: Field = 37..38;
}

/// Login flags byte.
mod flag {
    pub const TRANSIT: u8 = 0x80;
    pub const CONTINUE: u8 = 0x40;
    pub const CSG_SHIFT: u8 = 2;
    pub const STAGE_MASK: u8 = 0x03;
}

/// Login status classes (StatusClass of a Login Response).
pub mod status_class {
    /// The login proceeds.
    pub const SUCCESS: u8 = 0x00;
    /// The target moved; TargetAddress says where.
    pub const REDIRECT: u8 = 0x01;
    /// The initiator erred (authentication, unknown target, ...).
    pub const INITIATOR_ERROR: u8 = 0x02;
    /// The target failed.
    pub const TARGET_ERROR: u8 = 0x03;
}

/// The iSCSI version every implementation speaks (RFC 7143: 0x00).
pub const VERSION: u8 = 0x00;

/// A login stage (CSG / NSG).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum LoginStage {
    /// 0: security negotiation.
    SecurityNegotiation = 0,
    /// 1: login operational negotiation.
    OperationalNegotiation = 1,
    /// 3: full feature phase.
    FullFeature = 3,
}

impl LoginStage {
    /// Decodes a 2-bit stage.
    ///
    /// # Errors
    ///
    /// [`Error::ReservedStage`] for 2.
    pub const fn from_code(code: u8) -> Result<Self> {
        match code & flag::STAGE_MASK {
            0 => Ok(Self::SecurityNegotiation),
            1 => Ok(Self::OperationalNegotiation),
            3 => Ok(Self::FullFeature),
            _ => Err(Error::ReservedStage),
        }
    }
}

/// The stage fields shared by both directions.
fn decode_flags(flags: u8) -> Result<(LoginStage, Option<LoginStage>, bool)> {
    let transit = flags & flag::TRANSIT != 0;
    let more = flags & flag::CONTINUE != 0;
    if transit && more {
        return Err(Error::TransitAndContinue);
    }
    let current = LoginStage::from_code(flags >> flag::CSG_SHIFT)?;
    // NSG is meaningful only with the Transit bit.
    let next = if transit {
        Some(LoginStage::from_code(flags)?)
    } else {
        None
    };
    Ok((current, next, more))
}

fn encode_flags(current: LoginStage, next: Option<LoginStage>, more: bool) -> Result<u8> {
    if next.is_some() && more {
        return Err(Error::TransitAndContinue);
    }
    let mut flags = (current as u8) << flag::CSG_SHIFT;
    if let Some(next) = next {
        flags |= flag::TRANSIT | next as u8;
    }
    if more {
        flags |= flag::CONTINUE;
    }
    Ok(flags)
}

/// The value of a Login Request BHS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LoginRequestRepr {
    /// CSG.
    pub current_stage: LoginStage,
    /// NSG when the initiator asks to transit (T bit), else `None`.
    pub next_stage: Option<LoginStage>,
    /// C: the text continues in the next Login Request.
    pub continues: bool,
    /// Version-max.
    pub version_max: u8,
    /// Version-min.
    pub version_min: u8,
    /// Initiator session id part (6 bytes).
    pub isid: [u8; 6],
    /// Target session identifying handle (0 for a new session).
    pub tsih: u16,
    /// Initiator task tag.
    pub itt: u32,
    /// Connection id.
    pub cid: u16,
    /// CmdSN.
    pub cmd_sn: SerialNumber,
    /// ExpStatSN.
    pub exp_stat_sn: SerialNumber,
}

impl LoginRequestRepr {
    /// Parses a Login Request BHS.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::WrongOpcode`], [`Error::ReservedStage`],
    /// [`Error::TransitAndContinue`].
    pub fn parse<T: AsRef<[u8]>>(pdu: &LoginRequest<T>) -> Result<Self> {
        pdu.check_len()?;
        expect_opcode(pdu.opcode_code(), Opcode::LoginRequest)?;
        let (current_stage, next_stage, continues) = decode_flags(pdu.flags())?;
        Ok(Self {
            current_stage,
            next_stage,
            continues,
            version_max: pdu.version_max(),
            version_min: pdu.version_min(),
            isid: pdu.isid(),
            tsih: pdu.tsih(),
            itt: pdu.itt(),
            cid: pdu.cid(),
            cmd_sn: pdu.cmd_sn(),
            exp_stat_sn: pdu.exp_stat_sn(),
        })
    }

    /// Writes the BHS (immediate bit set, as RFC 7143 requires).
    ///
    /// # Errors
    ///
    /// [`Error::TransitAndContinue`] (a next stage with `continues`),
    /// [`Error::BufferTooSmall`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, pdu: &mut LoginRequest<T>) -> Result<()> {
        let flags = encode_flags(self.current_stage, self.next_stage, self.continues)?;
        start_emit(pdu.as_bytes_mut(), Opcode::LoginRequest, true)?;
        pdu.set_flags(flags);
        pdu.set_version_max(self.version_max);
        pdu.set_version_min(self.version_min);
        pdu.set_isid(self.isid);
        pdu.set_tsih(self.tsih);
        pdu.set_itt(self.itt);
        pdu.set_cid(self.cid);
        pdu.set_cmd_sn(self.cmd_sn);
        pdu.set_exp_stat_sn(self.exp_stat_sn);
        Ok(())
    }
}

bhs_view! {
    /// A view of a Login Request BHS.
    pub struct LoginRequest;
    /// Version-max.
    version_max, set_version_max: u8 = field::VERSION_MAX;
    /// Version-min.
    version_min, set_version_min: u8 = field::VERSION_MIN;
    /// ISID.
    isid, set_isid: [u8; 6] = field::ISID;
    /// TSIH.
    tsih, set_tsih: u16 = field::TSIH;
    /// Initiator task tag.
    itt, set_itt: u32 = field::ITT;
    /// Connection id.
    cid, set_cid: u16 = field::CID;
    /// CmdSN.
    cmd_sn, set_cmd_sn: SerialNumber = field::CMD_SN;
    /// ExpStatSN.
    exp_stat_sn, set_exp_stat_sn: SerialNumber = field::EXP_STAT_SN;
}

/// The value of a Login Response BHS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LoginResponseRepr {
    /// CSG.
    pub current_stage: LoginStage,
    /// NSG when the target agrees to transit (T bit), else `None`.
    pub next_stage: Option<LoginStage>,
    /// C: the text continues in the next Login Response.
    pub continues: bool,
    /// Version-max.
    pub version_max: u8,
    /// Version-active.
    pub version_active: u8,
    /// ISID, echoed.
    pub isid: [u8; 6],
    /// TSIH the target assigned (on the final response).
    pub tsih: u16,
    /// Initiator task tag, echoed.
    pub itt: u32,
    /// StatSN.
    pub stat_sn: SerialNumber,
    /// ExpCmdSN.
    pub exp_cmd_sn: SerialNumber,
    /// MaxCmdSN.
    pub max_cmd_sn: SerialNumber,
    /// Status class (see [`status_class`]).
    pub status_class: u8,
    /// Status detail, meaningful within its class.
    pub status_detail: u8,
}

impl LoginResponseRepr {
    /// Whether the login is proceeding (status class 0).
    pub const fn is_success(&self) -> bool {
        self.status_class == status_class::SUCCESS
    }

    /// Parses a Login Response BHS.
    ///
    /// # Errors
    ///
    /// [`Error::Truncated`], [`Error::WrongOpcode`], [`Error::ReservedStage`],
    /// [`Error::TransitAndContinue`].
    pub fn parse<T: AsRef<[u8]>>(pdu: &LoginResponse<T>) -> Result<Self> {
        pdu.check_len()?;
        expect_opcode(pdu.opcode_code(), Opcode::LoginResponse)?;
        let (current_stage, next_stage, continues) = decode_flags(pdu.flags())?;
        Ok(Self {
            current_stage,
            next_stage,
            continues,
            version_max: pdu.version_max(),
            version_active: pdu.version_active(),
            isid: pdu.isid(),
            tsih: pdu.tsih(),
            itt: pdu.itt(),
            stat_sn: pdu.stat_sn(),
            exp_cmd_sn: pdu.exp_cmd_sn(),
            max_cmd_sn: pdu.max_cmd_sn(),
            status_class: pdu.status_class(),
            status_detail: pdu.status_detail(),
        })
    }

    /// Writes the BHS.
    ///
    /// # Errors
    ///
    /// [`Error::TransitAndContinue`] (a next stage with `continues`),
    /// [`Error::BufferTooSmall`].
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, pdu: &mut LoginResponse<T>) -> Result<()> {
        let flags = encode_flags(self.current_stage, self.next_stage, self.continues)?;
        start_emit(pdu.as_bytes_mut(), Opcode::LoginResponse, false)?;
        pdu.set_flags(flags);
        pdu.set_version_max(self.version_max);
        pdu.set_version_active(self.version_active);
        pdu.set_isid(self.isid);
        pdu.set_tsih(self.tsih);
        pdu.set_itt(self.itt);
        pdu.set_stat_sn(self.stat_sn);
        pdu.set_exp_cmd_sn(self.exp_cmd_sn);
        pdu.set_max_cmd_sn(self.max_cmd_sn);
        pdu.set_status_class(self.status_class);
        pdu.set_status_detail(self.status_detail);
        Ok(())
    }
}

bhs_view! {
    /// A view of a Login Response BHS.
    pub struct LoginResponse;
    /// Version-max.
    version_max, set_version_max: u8 = field::VERSION_MAX;
    /// Version-active.
    version_active, set_version_active: u8 = field::VERSION_ACTIVE;
    /// ISID.
    isid, set_isid: [u8; 6] = field::ISID;
    /// TSIH.
    tsih, set_tsih: u16 = field::TSIH;
    /// Initiator task tag.
    itt, set_itt: u32 = field::ITT;
    /// StatSN.
    stat_sn, set_stat_sn: SerialNumber = field::STAT_SN;
    /// ExpCmdSN.
    exp_cmd_sn, set_exp_cmd_sn: SerialNumber = field::EXP_CMD_SN;
    /// MaxCmdSN.
    max_cmd_sn, set_max_cmd_sn: SerialNumber = field::MAX_CMD_SN;
    /// Status class.
    status_class, set_status_class: u8 = field::STATUS_CLASS;
    /// Status detail.
    status_detail, set_status_detail: u8 = field::STATUS_DETAIL;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_codes() {
        assert_eq!(
            LoginStage::from_code(0),
            Ok(LoginStage::SecurityNegotiation)
        );
        assert_eq!(
            LoginStage::from_code(1),
            Ok(LoginStage::OperationalNegotiation)
        );
        assert_eq!(LoginStage::from_code(2), Err(Error::ReservedStage));
        assert_eq!(LoginStage::from_code(3), Ok(LoginStage::FullFeature));
    }

    #[test]
    fn flags() {
        // T, CSG=1, NSG=3: 0x87.
        assert_eq!(
            encode_flags(
                LoginStage::OperationalNegotiation,
                Some(LoginStage::FullFeature),
                false
            ),
            Ok(0x87)
        );
        assert_eq!(
            encode_flags(
                LoginStage::SecurityNegotiation,
                Some(LoginStage::FullFeature),
                true
            ),
            Err(Error::TransitAndContinue)
        );
        assert_eq!(
            decode_flags(0x87),
            Ok((
                LoginStage::OperationalNegotiation,
                Some(LoginStage::FullFeature),
                false
            ))
        );
        // Without T, NSG is ignored even when it holds the reserved value.
        assert_eq!(
            decode_flags(0x46),
            Ok((LoginStage::OperationalNegotiation, None, true))
        );
        assert_eq!(decode_flags(0xC7), Err(Error::TransitAndContinue));
        assert_eq!(decode_flags(0x08), Err(Error::ReservedStage));
        assert_eq!(decode_flags(0x86), Err(Error::ReservedStage));
    }

    #[test]
    fn request_wrong_opcode_and_truncated() {
        let mut buf = [0u8; 48];
        buf[0] = 0x43;
        assert!(LoginRequestRepr::parse(&LoginRequest::new_unchecked(&buf[..])).is_ok());
        assert_eq!(
            LoginRequestRepr::parse(&LoginRequest::new_unchecked(&buf[..47])),
            Err(Error::Truncated)
        );
        buf[0] = 0x23;
        assert_eq!(
            LoginRequestRepr::parse(&LoginRequest::new_unchecked(&buf[..])),
            Err(Error::WrongOpcode(0x23))
        );
        assert_eq!(
            LoginResponseRepr::parse(&LoginResponse::new_unchecked(&[0x03u8; 48][..])),
            Err(Error::WrongOpcode(0x03))
        );
    }
}
