//! Memory registration plan: a scatter/gather list cut into the runs one
//! fast-registration MR each can cover.
//!
//! A fast-registered MR maps a list of whole pages at consecutive I/O
//! virtual addresses; only its first page may start at an offset and only
//! its last may end early. A scatter/gather list from StorPort is any
//! list of physical segments, so [`plan`] cuts it where a segment does not
//! start or end on a page boundary (the `SG_GAPS` case Linux avoids with a
//! virtual boundary mask, which StorPort has no equivalent of) and where a
//! run would exceed the MR's page list. Each run becomes one MR and one
//! data buffer descriptor: one run is a direct descriptor, several an
//! indirect one with the list inline in the command.
//!
//! A buffer from one MDL (the usual case) is one run per `max_pages`
//! pages. The plan also says how many send-queue entries the command can
//! ever need ([`Plan::send_queue_cost`]), so the channel can reserve them
//! before posting and never see a full send queue on the completion path,
//! where the invalidations must go out.
//!
//! # IRQL
//! Pure computation into caller-provided arrays: any IRQL.

#![forbid(unsafe_code)]

use hca_lowlevel::dma::PhysAddr;

use crate::storport::SgElement;

/// log2 of the page size MRs are registered with.
pub const PAGE_SHIFT: u8 = 12;
/// The page size MRs are registered with.
pub const PAGE: u64 = 1 << PAGE_SHIFT;
const PAGE_MASK: u64 = PAGE - 1;
/// Page-list entries that go inline in a REG_MR WQE (kverbs'
/// `INLINE_PAGES`); longer lists use the MR's page-list buffer.
const INLINE_PAGES: u32 = 4;

/// One MR's worth of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Run {
    /// Index of the run's first page in the page array.
    pub first_page: u32,
    /// Pages in the run.
    pub pages: u32,
    /// Offset of the first byte in the first page.
    pub offset: u32,
    /// Bytes in the run.
    pub len: u32,
    /// Offset of the run's first byte in the transfer.
    pub transfer_offset: u32,
}

impl Run {
    /// Whether the run ends on a page boundary (another page may follow).
    const fn ends_aligned(&self) -> bool {
        (self.offset as u64 + self.len as u64) & PAGE_MASK == 0
    }
}

/// Why a scatter/gather list cannot be registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MapError {
    /// The list holds fewer bytes than the transfer.
    ListTooShort,
    /// More runs than the command can describe.
    TooManyRuns,
    /// More pages than the page array holds.
    TooManyPages,
    /// A segment's address range wraps around.
    AddressOverflow,
    /// `max_pages` is zero.
    NoPages,
}

/// A registration plan (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Plan {
    /// Runs filled in.
    pub runs: usize,
    /// Pages filled in.
    pub pages: usize,
    /// WQEBBs the runs' registrations can take at post: per run a REG_MR
    /// ([`reg_mr_wqebbs`]) and the LOCAL_INV `reg_mr` chains in front when
    /// its MR came back registered. Counted once, by the cut that knows
    /// the runs, so neither the reservation at prepare nor the room check
    /// at post walks the runs again.
    pub reg_wqebbs: u32,
}

impl Plan {
    /// Send-queue WQEBBs the command can need: the registrations
    /// ([`Plan::reg_wqebbs`]), per run the LOCAL_INV after the response,
    /// and one SEND for the IU.
    #[must_use]
    pub fn send_queue_cost(&self) -> u32 {
        let invalidations = u32::try_from(self.runs).unwrap_or(u32::MAX);
        self.reg_wqebbs
            .saturating_add(invalidations)
            .saturating_add(1)
    }
}

/// WQEBBs of a REG_MR of `pages` pages (kverbs writes up to four pages
/// inline after the 16-byte control and 32-byte registration segments).
#[must_use]
pub const fn reg_mr_wqebbs(pages: u32) -> u32 {
    if pages <= INLINE_PAGES {
        (16 + 32 + (pages * 8).div_ceil(16) * 16).div_ceil(64)
    } else {
        1
    }
}

/// Cuts the first `len` bytes of `sg` into runs of at most `max_pages`
/// pages, writing the pages to `pages` and the runs to `runs`.
///
/// Zero-length segments are skipped. Segments past `len` are ignored.
///
/// # Errors
/// [`MapError`]; nothing written is meaningful then.
pub fn plan(
    sg: &[SgElement],
    len: u32,
    max_pages: u32,
    pages: &mut [PhysAddr],
    runs: &mut [Run],
) -> Result<Plan, MapError> {
    match plan_one_segment(sg, len, max_pages, pages, runs) {
        Some(plan) => Ok(plan),
        None => plan_general(sg, len, max_pages, pages, runs),
    }
}

/// The usual list — its first segment holds the whole transfer, within
/// one MR's pages — planned without the general cut: one run, its pages
/// in a row. The result is the general cut's for the same list (the tests
/// compare them); `None` leaves any other list, and every error, to it.
fn plan_one_segment(
    sg: &[SgElement],
    len: u32,
    max_pages: u32,
    pages: &mut [PhysAddr],
    runs: &mut [Run],
) -> Option<Plan> {
    let segment = sg.first()?;
    if len == 0 || segment.len < len {
        return None;
    }
    let start = segment.phys.0;
    let end = start.checked_add(u64::from(len))?;
    let first = start & !PAGE_MASK;
    // `end - 1 >= start`: `len > 0`.
    let count = (((end - 1) & !PAGE_MASK) - first) / PAGE + 1;
    let count = u32::try_from(count).ok().filter(|c| *c <= max_pages)?;
    let out = pages.get_mut(..usize::try_from(count).ok()?)?;
    let run = runs.first_mut()?;
    let mut page = first;
    for entry in out {
        *entry = PhysAddr(page);
        page = page.wrapping_add(PAGE);
    }
    *run = Run {
        first_page: 0,
        pages: count,
        offset: (start & PAGE_MASK) as u32,
        len,
        transfer_offset: 0,
    };
    Some(Plan {
        runs: 1,
        pages: usize::try_from(count).ok()?,
        reg_wqebbs: 1 + reg_mr_wqebbs(count),
    })
}

/// [`plan`] for any list.
fn plan_general(
    sg: &[SgElement],
    len: u32,
    max_pages: u32,
    pages: &mut [PhysAddr],
    runs: &mut [Run],
) -> Result<Plan, MapError> {
    if max_pages == 0 {
        return Err(MapError::NoPages);
    }
    let mut plan = Plan::default();
    let mut left = len;
    let mut done = 0u32;
    for element in sg {
        if left == 0 {
            break;
        }
        let take = element.len.min(left);
        if take == 0 {
            continue;
        }
        let start = element.phys.0;
        start
            .checked_add(u64::from(take))
            .ok_or(MapError::AddressOverflow)?;
        let mut at = start;
        let mut rest = take;
        while rest > 0 {
            // Continue the current run only from a page boundary onto a
            // page boundary, within the page limit.
            let current = plan
                .runs
                .checked_sub(1)
                .and_then(|i| runs.get(i).copied())
                .filter(|r| r.ends_aligned() && at & PAGE_MASK == 0 && r.pages < max_pages);
            let mut run = match current {
                Some(r) => r,
                None => {
                    let run = Run {
                        first_page: u32::try_from(plan.pages)
                            .map_err(|_| MapError::TooManyPages)?,
                        pages: 0,
                        offset: (at & PAGE_MASK) as u32,
                        len: 0,
                        transfer_offset: done,
                    };
                    *runs.get_mut(plan.runs).ok_or(MapError::TooManyRuns)? = run;
                    plan.runs += 1;
                    run
                }
            };
            // Bytes from `at` up to the end of the pages this run may still
            // take.
            let room_pages = u64::from(max_pages - run.pages);
            let to_limit = room_pages * PAGE - (at & PAGE_MASK);
            let n = u64::from(rest).min(to_limit);
            let n32 = u32::try_from(n).map_err(|_| MapError::TooManyPages)?;
            let first = at & !PAGE_MASK;
            let last = (at + n - 1) & !PAGE_MASK;
            let mut page = first;
            loop {
                *pages.get_mut(plan.pages).ok_or(MapError::TooManyPages)? = PhysAddr(page);
                plan.pages += 1;
                run.pages += 1;
                if page == last {
                    break;
                }
                page += PAGE;
            }
            run.len += n32;
            if let Some(slot) = runs.get_mut(plan.runs - 1) {
                *slot = run;
            }
            at += n;
            rest -= n32;
            done += n32;
            left -= n32;
        }
    }
    if left > 0 {
        return Err(MapError::ListTooShort);
    }
    plan.reg_wqebbs = runs
        .iter()
        .take(plan.runs)
        .map(|r| 1 + reg_mr_wqebbs(r.pages))
        .sum();
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn seg(phys: u64, len: u32) -> SgElement {
        SgElement {
            phys: PhysAddr(phys),
            len,
        }
    }

    fn run(sg: &[SgElement], len: u32, max_pages: u32) -> Result<(Vec<Run>, Vec<u64>), MapError> {
        let mut pages = vec![PhysAddr(0); 4096];
        let mut runs = vec![Run::default(); 512];
        let p = plan(sg, len, max_pages, &mut pages, &mut runs)?;
        Ok((
            runs[..p.runs].to_vec(),
            pages[..p.pages].iter().map(|p| p.0).collect(),
        ))
    }

    fn segments() -> impl Strategy<Value = Vec<SgElement>> {
        let phys = prop_oneof![
            (0u64..64).prop_map(|p| p * PAGE),
            (0u64..64 * PAGE),
            (u64::MAX - 3 * PAGE..=u64::MAX),
        ];
        let len = prop_oneof![
            Just(0u32),
            1u32..=3 * PAGE as u32,
            (1u32..=4).prop_map(|p| p * PAGE as u32)
        ];
        prop::collection::vec((phys, len).prop_map(|(p, l)| seg(p, l)), 0..4)
    }

    proptest! {
        /// The one-segment plan is the general cut's, whenever it applies
        /// (and for every list whether it does or not).
        #[test]
        fn one_segment_plan_is_the_general_one(
            sg in segments(),
            len in prop_oneof![0u32..=4 * PAGE as u32, Just(PAGE as u32)],
            max_pages in 0u32..6,
            page_room in 0usize..8,
            run_room in 0usize..3,
        ) {
            let mut pages = vec![PhysAddr(7); page_room];
            let mut runs = vec![Run::default(); run_room];
            let fast = plan(&sg, len, max_pages, &mut pages, &mut runs);
            let mut pages_g = vec![PhysAddr(7); page_room];
            let mut runs_g = vec![Run::default(); run_room];
            let general = plan_general(&sg, len, max_pages, &mut pages_g, &mut runs_g);
            prop_assert_eq!(fast, general);
            if let Ok(p) = fast {
                prop_assert_eq!(&runs[..p.runs], &runs_g[..p.runs]);
                prop_assert_eq!(&pages[..p.pages], &pages_g[..p.pages]);
            }
        }
    }

    #[test]
    fn one_segment_plan_applies_to_a_page() {
        let mut pages = [PhysAddr(0); 2];
        let mut runs = [Run::default(); 1];
        let sg = [seg(0x7_0000, 4096)];
        assert!(plan_one_segment(&sg, 4096, 4, &mut pages, &mut runs).is_some());
        assert!(plan_one_segment(&sg, 4096, 0, &mut pages, &mut runs).is_none());
    }

    #[test]
    fn contiguous_buffer_is_one_run() {
        let (runs, pages) = run(&[seg(0x10_0000, 16384)], 16384, 256).unwrap();
        assert_eq!(runs.len(), 1);
        assert_eq!(
            runs[0],
            Run {
                first_page: 0,
                pages: 4,
                offset: 0,
                len: 16384,
                transfer_offset: 0
            }
        );
        assert_eq!(pages, vec![0x10_0000, 0x10_1000, 0x10_2000, 0x10_3000]);
    }

    #[test]
    fn an_mdl_shape_is_one_run() {
        // Offset start, whole pages in the middle anywhere, short end.
        let sg = [
            seg(0x5_0200, 0xe00),
            seg(0x9_0000, 0x1000),
            seg(0x3_0000, 0x1000),
            seg(0x7_0000, 0x10),
        ];
        let (runs, pages) = run(&sg, 0xe00 + 0x2010, 256).unwrap();
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[0].offset, 0x200);
        assert_eq!(runs[0].len, 0x2e10);
        assert_eq!(pages, vec![0x5_0000, 0x9_0000, 0x3_0000, 0x7_0000]);
    }

    #[test]
    fn gaps_cut_runs() {
        // A segment ending mid-page, then one starting mid-page.
        let sg = [seg(0x1000, 100), seg(0x8010, 50), seg(0x9000, 4096)];
        let (runs, _) = run(&sg, 4246, 256).unwrap();
        assert_eq!(runs.len(), 3);
        assert_eq!(
            (runs[0].offset, runs[0].len, runs[0].transfer_offset),
            (0, 100, 0)
        );
        assert_eq!(
            (runs[1].offset, runs[1].len, runs[1].transfer_offset),
            (0x10, 50, 100)
        );
        assert_eq!(
            (runs[2].offset, runs[2].len, runs[2].transfer_offset),
            (0, 4096, 150)
        );
    }

    #[test]
    fn page_limit_splits_on_page_boundaries() {
        let (runs, pages) = run(&[seg(0x10_0800, 5 * 4096)], 5 * 4096, 2).unwrap();
        // 6 pages touched, 2 per MR.
        assert_eq!(runs.len(), 3);
        assert_eq!(pages.len(), 6);
        assert_eq!((runs[0].offset, runs[0].len), (0x800, 0x1800));
        assert_eq!((runs[1].offset, runs[1].len), (0, 0x2000));
        assert_eq!((runs[2].offset, runs[2].len), (0, 0x1800));
        assert_eq!(runs.iter().map(|r| r.len).sum::<u32>(), 5 * 4096);
    }

    #[test]
    fn transfer_length_bounds_the_list() {
        let sg = [seg(0x1000, 4096), seg(0x5000, 4096)];
        let (runs, pages) = run(&sg, 10, 16).unwrap();
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[0].len, 10);
        assert_eq!(pages.len(), 1);
        assert_eq!(run(&sg, 8193, 16), Err(MapError::ListTooShort));
        assert_eq!(
            run(&[seg(0x1000, 0), seg(0x2000, 8)], 8, 16)
                .unwrap()
                .0
                .len(),
            1
        );
        assert_eq!(run(&sg, 0, 16).unwrap().0.len(), 0);
    }

    #[test]
    fn limits_are_errors() {
        let mut pages = [PhysAddr(0); 2];
        let mut runs = [Run::default(); 1];
        assert_eq!(
            plan(&[seg(0, 3 * 4096)], 3 * 4096, 8, &mut pages, &mut runs),
            Err(MapError::TooManyPages)
        );
        let mut pages = [PhysAddr(0); 8];
        assert_eq!(
            plan(&[seg(1, 10), seg(0x3001, 10)], 20, 8, &mut pages, &mut runs),
            Err(MapError::TooManyRuns)
        );
        assert_eq!(
            plan(&[seg(u64::MAX - 2, 10)], 10, 8, &mut pages, &mut runs),
            Err(MapError::AddressOverflow)
        );
        assert_eq!(
            plan(&[seg(0, 10)], 10, 0, &mut pages, &mut runs),
            Err(MapError::NoPages)
        );
    }

    #[test]
    fn send_queue_cost() {
        assert_eq!(reg_mr_wqebbs(1), 1);
        assert_eq!(reg_mr_wqebbs(2), 1);
        assert_eq!(reg_mr_wqebbs(3), 2);
        assert_eq!(reg_mr_wqebbs(4), 2);
        assert_eq!(reg_mr_wqebbs(5), 1);
        assert_eq!(reg_mr_wqebbs(256), 1);
        // Two runs: one page, then three (the second segment starts
        // inside a page, so it cannot continue the first run).
        let mut pages = [PhysAddr(0); 8];
        let mut runs = [Run::default(); 4];
        let sg = [seg(0x1000, 4096), seg(0x20_0800, 8192)];
        let p = plan(&sg, 4096 + 8192, 8, &mut pages, &mut runs).unwrap();
        assert_eq!((p.runs, runs[0].pages, runs[1].pages), (2, 1, 3));
        assert_eq!(p.reg_wqebbs, (1 + 1) + (1 + 2));
        assert_eq!(p.send_queue_cost(), 1 + (1 + 1 + 1) + (1 + 2 + 1));
        // The one-segment cut counts its run too.
        let p = plan(&[seg(0x3000, 3 * 4096)], 3 * 4096, 8, &mut pages, &mut runs).unwrap();
        assert_eq!((p.runs, p.reg_wqebbs), (1, 1 + 2));
        assert_eq!(p.send_queue_cost(), 1 + (1 + 2 + 1));
        assert_eq!(Plan::default().send_queue_cost(), 1);
    }

    fn arb_sg() -> impl Strategy<Value = Vec<SgElement>> {
        proptest::collection::vec((0u64..1 << 30, 0u32..20_000), 1..40).prop_map(|v| {
            v.into_iter()
                .map(|(phys, len)| seg(phys, len))
                .collect::<Vec<_>>()
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(
            std::env::var("SRP_MAPPING_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(128)
        ))]

        /// Every byte of the transfer is covered exactly once, in order,
        /// by pages the runs own, and every run is a legal MR.
        #[test]
        fn runs_cover_the_transfer(sg in arb_sg(), cut in any::<u32>(), max_pages in 1u32..64) {
            let total: u32 = sg.iter().map(|s| s.len).sum();
            let len = if total == 0 { 0 } else { cut % (total + 1) };
            let (runs, pages) = run(&sg, len, max_pages).unwrap();
            // Expected byte addresses, in transfer order.
            let mut want = Vec::new();
            let mut left = len;
            for s in &sg {
                let n = s.len.min(left);
                for i in 0..u64::from(n) { want.push(s.phys.0 + i); }
                left -= n;
            }
            let mut got = Vec::new();
            let mut offset = 0u32;
            for r in &runs {
                prop_assert!(r.pages >= 1 && r.pages <= max_pages);
                prop_assert!(r.len > 0);
                prop_assert_eq!(r.transfer_offset, offset);
                prop_assert!(u64::from(r.offset) + u64::from(r.len) <= u64::from(r.pages) * PAGE);
                prop_assert!(u64::from(r.offset) + u64::from(r.len) > (u64::from(r.pages) - 1) * PAGE);
                for b in 0..u64::from(r.len) {
                    let v = u64::from(r.offset) + b;
                    let page = pages[(r.first_page + (v / PAGE) as u32) as usize];
                    prop_assert_eq!(page & PAGE_MASK, 0);
                    got.push(page + v % PAGE);
                }
                offset += r.len;
            }
            prop_assert_eq!(got, want);
        }
    }
}
