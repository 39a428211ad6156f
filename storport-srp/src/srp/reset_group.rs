//! One LOGICAL UNIT RESET carried as a TMF on every live channel.
//!
//! RC orders an IU only behind the IUs of its own QP. A reset sent on one
//! channel can reach the target before commands still in flight on another
//! channel; the target then runs those after the initiator has completed
//! them and fenced their memory, its RDMA hits an invalidated key and the
//! connection dies. So a LUN reset goes out on every live channel, each
//! covers the commands its channel carried before it (a command posted on
//! the channel after the TMF is a new task to the target: it runs, and
//! completes with its own response), and the core hears once, when every
//! channel has answered, with the first failure if any.

#![forbid(unsafe_code)]

use kverbs::irql::LeDispatch;
use kverbs::platform::Platform;
use kverbs::sync::SpinLock;

use crate::miniport::transport::{Tag, TmfResponse};

/// LUN resets in progress at once: each holds a TMF slot of every channel,
/// so no more than a channel has slots.
pub(crate) const MAX_RESET_GROUPS: usize = super::engine::TMF_SLOTS as usize;

/// One reset in progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Group {
    core: Tag,
    /// Members that have not answered (plus the sender's hold).
    remaining: u8,
    /// The first failure a member reported.
    failure: Option<TmfResponse>,
}

/// The pure bookkeeping, separate from the lock so it can be tested alone.
#[derive(Debug, Default)]
pub(crate) struct GroupTable {
    groups: heapless::Vec<Group, MAX_RESET_GROUPS>,
}

impl GroupTable {
    /// Starts a group of `members` answers for `core`; `false` if the
    /// table is full or `core` already has one.
    pub(crate) fn open(&mut self, core: Tag, members: u8) -> bool {
        if members == 0 || self.contains(core) {
            return false;
        }
        self.groups
            .push(Group {
                core,
                remaining: members,
                failure: None,
            })
            .is_ok()
    }

    /// Whether `core` is a group's.
    pub(crate) fn contains(&self, core: Tag) -> bool {
        self.groups.iter().any(|g| g.core == core)
    }

    /// One member of `core`'s group answered `response`; the group's
    /// answer when it was the last (`None` while others are outstanding,
    /// or if `core` has no group).
    pub(crate) fn member_done(&mut self, core: Tag, response: TmfResponse) -> Option<TmfResponse> {
        let i = self.groups.iter().position(|g| g.core == core)?;
        let g = self.groups.get_mut(i)?;
        if !matches!(response, TmfResponse::Complete | TmfResponse::Succeeded)
            && g.failure.is_none()
        {
            g.failure = Some(response);
        }
        g.remaining = g.remaining.saturating_sub(1);
        if g.remaining > 0 {
            return None;
        }
        let answer = g.failure.unwrap_or(TmfResponse::Complete);
        self.groups.swap_remove(i);
        Some(answer)
    }
}

/// [`GroupTable`] under a spin lock, shared by every channel's completion
/// path.
pub(crate) struct ResetGroups<P: Platform> {
    table: SpinLock<GroupTable, P>,
}

impl<P: Platform> ResetGroups<P> {
    pub(crate) fn new() -> Self {
        ResetGroups {
            table: SpinLock::new(GroupTable::default()),
        }
    }

    /// See [`GroupTable::open`].
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub(crate) fn open(&self, core: Tag, members: u8, irql: &impl LeDispatch) -> bool {
        self.table.lock(irql).open(core, members)
    }

    /// See [`GroupTable::contains`].
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub(crate) fn contains(&self, core: Tag, irql: &impl LeDispatch) -> bool {
        self.table.lock(irql).contains(core)
    }

    /// See [`GroupTable::member_done`].
    ///
    /// # IRQL
    /// <= `DISPATCH_LEVEL`.
    pub(crate) fn member_done(
        &self,
        core: Tag,
        response: TmfResponse,
        irql: &impl LeDispatch,
    ) -> Option<TmfResponse> {
        self.table.lock(irql).member_done(core, response)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::miniport::transport::FailureKind;

    #[test]
    fn the_last_member_answers_with_the_first_failure() {
        let mut t = GroupTable::default();
        assert!(t.open(Tag(7), 3));
        assert!(!t.open(Tag(7), 2), "one group per TMF");
        assert_eq!(t.member_done(Tag(7), TmfResponse::Complete), None);
        assert_eq!(t.member_done(Tag(7), TmfResponse::Failed), None);
        let timeout = TmfResponse::Transport(FailureKind::Timeout);
        assert_eq!(t.member_done(Tag(7), timeout), Some(TmfResponse::Failed));
        assert!(!t.contains(Tag(7)));
        assert_eq!(t.member_done(Tag(7), TmfResponse::Complete), None);
    }

    #[test]
    fn all_complete_is_complete_and_the_table_is_bounded() {
        let mut t = GroupTable::default();
        for i in 0..MAX_RESET_GROUPS {
            assert!(t.open(Tag(i as u32), 2));
        }
        assert!(!t.open(Tag(99), 1), "full");
        assert!(!t.open(Tag(100), 0), "a group of nobody");
        assert_eq!(t.member_done(Tag(1), TmfResponse::Succeeded), None);
        assert_eq!(
            t.member_done(Tag(1), TmfResponse::Complete),
            Some(TmfResponse::Complete)
        );
        assert!(t.open(Tag(99), 1), "a freed entry is reused");
    }
}
