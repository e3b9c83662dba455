//! Choosing host memory for `to: auto`: which kinds this kernel can give
//! now (the THP policies, the hugetlb pool), what each costs here (the
//! figures `dmaload info --probe-memory` recorded), and the rule between
//! them. The facts are a plain value ([`MemoryFacts`]), read from /sys and
//! /proc by [`MemoryFacts::read`] or built by hand, so the rule is testable
//! on any machine.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::{Allocation, MemoryKind};
use crate::sys;
use crate::system::{bracketed_choice, THP_ANONYMOUS, THP_SHMEM};

/// The one line an administrator can run to let memfds get 2 MiB pages.
pub const SHMEM_HUGE_PAGES_HINT: &str = "echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled";

/// What decides which memory kinds a load can have now.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MemoryFacts {
    /// The selected value of `transparent_hugepage/enabled` (anonymous
    /// memory): `always`, `madvise` or `never`; `None` without THP.
    pub thp_anonymous: Option<String>,
    /// The selected value of `transparent_hugepage/shmem_enabled` (memfds):
    /// `always`, `within_size`, `advise`, `never`, `deny` or `force`.
    pub thp_shmem: Option<String>,
    /// The default huge page size (`Hugepagesize`), 0 without hugetlb.
    pub hugetlb_page_size: u64,
    /// Pages in the hugetlb pool (`HugePages_Total`).
    pub hugetlb_total_pages: u64,
    /// Free pages of the pool that no one has reserved
    /// (`HugePages_Free - HugePages_Rsvd`).
    pub hugetlb_free_pages: u64,
    /// The soft RLIMIT_FSIZE in bytes (`None`: unlimited): a memfd is a
    /// file, and cannot be sized past it.
    pub file_size_limit: Option<u64>,
    /// Whether a virtio balloon reports free memory to its host (see
    /// [`crate::system::free_page_reporting`]): then huge pages are slow
    /// to populate cold, and only measurement can tell whether they pay.
    pub free_page_reporting: bool,
    /// The running kernel, to match recorded probe figures against.
    pub kernel: String,
    /// The figures `dmaload info --probe-memory` recorded, if any.
    pub probe: Option<MemoryProbe>,
    /// Why recorded figures exist but could not be read (`auto` then goes
    /// by rule, and says so).
    pub probe_error: Option<String>,
}

/// The kind `auto` chose, and why, in words for a report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemoryChoice {
    pub kind: MemoryKind,
    pub reason: String,
}

impl MemoryFacts {
    /// The facts of this machine now, with the recorded probe figures from
    /// [`probe_path`] when there are any.
    pub fn read() -> MemoryFacts {
        let meminfo = fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let count = |name: &str| meminfo_number(&meminfo, name).unwrap_or(0);
        let recorded = probe_path().map(|path| MemoryProbe::read(&path)).transpose();
        let (probe, probe_error) = match recorded {
            Ok(probe) => (probe.flatten(), None),
            Err(err) => (None, Some(err.to_string())),
        };
        MemoryFacts {
            thp_anonymous: bracketed_choice(THP_ANONYMOUS),
            thp_shmem: bracketed_choice(THP_SHMEM),
            hugetlb_page_size: count("Hugepagesize:") * 1024,
            hugetlb_total_pages: count("HugePages_Total:"),
            hugetlb_free_pages: count("HugePages_Free:").saturating_sub(count("HugePages_Rsvd:")),
            free_page_reporting: crate::system::free_page_reporting().is_some(),
            file_size_limit: sys::process::file_size_limit().ok().flatten(),
            kernel: sys::process::kernel_release().unwrap_or_default(),
            probe,
            probe_error,
        }
    }

    /// How long to wait after freeing memory before it is back with the
    /// host under free page reporting (`None` without it): a measurement
    /// that waits this long meets memory as a load after idle does.
    pub fn reporting_settle(&self) -> Option<std::time::Duration> {
        self.free_page_reporting.then_some(REPORTING_SETTLE)
    }

    /// Whether `kind` memory gets 2 MiB (or larger) pages under these
    /// policies.
    pub fn huge_pages(&self, kind: MemoryKind) -> bool {
        match kind {
            MemoryKind::Memfd | MemoryKind::Anonymous => false,
            MemoryKind::MemfdHuge => {
                matches!(self.thp_shmem.as_deref(), Some("always" | "within_size" | "advise" | "force"))
            }
            MemoryKind::Hugetlb => true,
            MemoryKind::AnonymousThp => matches!(self.thp_anonymous.as_deref(), Some("always" | "madvise")),
        }
    }

    /// Whether `len` bytes of `kind` memory can be had now, and if not why
    /// and what would change it.
    pub fn can_give(&self, kind: MemoryKind, len: u64) -> Result<(), String> {
        if let Some(limit) = self.file_size_limit.filter(|&limit| kind.has_fd() && len > limit) {
            return Err(format!(
                "{len} bytes are past RLIMIT_FSIZE ({limit} bytes), which limits memfds like files: raise it \
                 (ulimit -f) or use anonymous-thp memory"
            ));
        }
        match kind {
            MemoryKind::Memfd | MemoryKind::AnonymousThp | MemoryKind::Anonymous => Ok(()),
            MemoryKind::MemfdHuge if self.huge_pages(kind) => Ok(()),
            MemoryKind::MemfdHuge => Err(format!(
                "the shmem THP policy ({THP_SHMEM}) is {}, so memfd pages stay 4 KiB; as root, `{}` allows \
                 2 MiB pages for memfds that ask for them",
                self.thp_shmem.as_deref().unwrap_or("absent (kernel without THP)"),
                SHMEM_HUGE_PAGES_HINT
            )),
            MemoryKind::Hugetlb => {
                if self.hugetlb_page_size == 0 {
                    return Err("this kernel has no hugetlb pages (no Hugepagesize in /proc/meminfo)".into());
                }
                let needed = len.div_ceil(self.hugetlb_page_size).max(1);
                if self.hugetlb_free_pages >= needed {
                    return Ok(());
                }
                Err(format!(
                    "the hugetlb pool has {} free pages of {} MiB, {needed} needed; as root, `echo {} > \
                     /proc/sys/vm/nr_hugepages` grows it",
                    self.hugetlb_free_pages,
                    self.hugetlb_page_size >> 20,
                    self.hugetlb_total_pages + needed - self.hugetlb_free_pages
                ))
            }
        }
    }

    /// The sysfs line an administrator could run so that `auto` gets huge
    /// pages for shareable memory; `None` where memfds already get them.
    pub fn huge_pages_hint(&self) -> Option<&'static str> {
        (!self.huge_pages(MemoryKind::MemfdHuge)).then_some(SHMEM_HUGE_PAGES_HINT)
    }

    /// What `auto` gives a load of `len` bytes: among the kinds it can have
    /// now (no anonymous memory when the caller `needs_fd`), the cheapest
    /// one the recorded probe measured, where it matches this machine;
    /// else by rule: a memfd with huge pages when the shmem policy allows,
    /// a hugetlb memfd when the pool has room, anonymous THP when no fd is
    /// needed and THP is on, else 4 KiB pages: anonymous ones when no fd is
    /// needed (cheaper to populate than a memfd's), else a memfd. Under
    /// free page reporting the rule leaves out transparent huge pages (cold
    /// ones cost several times what 4 KiB pages do there) until a probe
    /// measures them; the hugetlb pool is never reported, so it stays.
    pub fn choose(&self, len: u64, needs_fd: bool) -> MemoryChoice {
        let usable = |kind: MemoryKind| (kind.has_fd() || !needs_fd) && self.can_give(kind, len).is_ok();
        let mut stale = match &self.probe_error {
            Some(err) => format!(
                " (recorded probe figures unreadable: {err}; `dmaload info --probe-memory` records them anew)"
            ),
            None => String::new(),
        };
        if let Some(probe) = &self.probe {
            match probe.matches(self) {
                Ok(()) => {
                    let mut measured: Vec<(MemoryKind, f64)> = probe
                        .kinds
                        .iter()
                        .filter(|k| usable(k.kind))
                        .filter_map(|k| Some((k.kind, k.populate_seconds_per_gib?)))
                        .collect();
                    measured.sort_by(|a, b| a.1.total_cmp(&b.1));
                    if let Some(&(kind, _)) = measured.first() {
                        let figures: Vec<String> =
                            measured.iter().map(|(k, s)| format!("{k} {s:.3} s/GiB")).collect();
                        return MemoryChoice {
                            kind,
                            reason: format!(
                                "the cheapest to populate of the kinds this load can use, as `dmaload info \
                                 --probe-memory` measured here: {}",
                                figures.join(", ")
                            ),
                        };
                    }
                }
                Err(why) => stale = format!(" (recorded probe figures ignored: {why})"),
            }
        }
        let shmem = self.thp_shmem.as_deref().unwrap_or("absent");
        // Transparent huge pages the rule would take, and whether free page
        // reporting makes it leave them out.
        let thp = [MemoryKind::MemfdHuge, MemoryKind::AnonymousThp]
            .map(|kind| usable(kind) && self.huge_pages(kind) && (kind.has_fd() || !needs_fd));
        if self.free_page_reporting && thp.contains(&true) {
            stale += " (transparent huge pages left out: free page reporting is on, where cold huge pages \
                      cost more than 4 KiB ones; `dmaload info --probe-memory` measures which pays here)";
        }
        let thp_usable =
            |kind| !self.free_page_reporting && thp[usize::from(kind == MemoryKind::AnonymousThp)];
        let (kind, reason) = if thp_usable(MemoryKind::MemfdHuge) {
            (MemoryKind::MemfdHuge, format!("shmem_enabled is {shmem}: a memfd that asks gets 2 MiB pages"))
        } else if usable(MemoryKind::Hugetlb) {
            (
                MemoryKind::Hugetlb,
                format!(
                    "shmem_enabled is {shmem}, but the hugetlb pool has {} free pages of {} MiB, enough",
                    self.hugetlb_free_pages,
                    self.hugetlb_page_size >> 20
                ),
            )
        } else if thp_usable(MemoryKind::AnonymousThp) {
            (
                MemoryKind::AnonymousThp,
                format!(
                    "no fd needed, and anonymous memory gets 2 MiB pages (THP enabled is {}) where a memfd \
                     would get 4 KiB (shmem_enabled is {shmem}, hugetlb pool too small)",
                    self.thp_anonymous.as_deref().unwrap_or("absent")
                ),
            )
        } else {
            let no_huge_memfd = if let Err(why) = self.can_give(MemoryKind::Memfd, len) {
                format!("no memfd possible: {why}")
            } else if self.huge_pages(MemoryKind::MemfdHuge) {
                "the hugetlb pool is too small".to_owned()
            } else {
                format!("no huge pages for a memfd here (shmem_enabled is {shmem}, hugetlb pool too small)")
            };
            if needs_fd {
                (MemoryKind::Memfd, format!("4 KiB memfd: an fd is needed, and {no_huge_memfd}"))
            } else {
                (
                    MemoryKind::Anonymous,
                    format!(
                        "4 KiB anonymous pages: no fd needed, and {no_huge_memfd}{}; anonymous 4 KiB pages cost \
                         less to populate than a memfd's",
                        match self.thp_anonymous.as_deref() {
                            Some(anon) if !self.huge_pages(MemoryKind::AnonymousThp) => {
                                format!(" nor for anonymous memory (THP enabled is {anon})")
                            }
                            _ => String::new(),
                        }
                    ),
                )
            }
        };
        MemoryChoice { kind, reason: reason + &stale }
    }

    /// Whether files cached in 4 KiB memfd pages are collapsed into 2 MiB
    /// pages afterwards: where the shmem policy gives memfds no huge pages
    /// but lets `MADV_COLLAPSE` make them (every policy but `deny`; the
    /// kernel may still refuse, before 6.1).
    pub fn collapses_shared(&self) -> bool {
        !self.huge_pages(MemoryKind::MemfdHuge) && matches!(self.thp_shmem.as_deref(), Some(p) if p != "deny")
    }

    /// The kind for memory filled once and then mapped by many processes
    /// (the cache service's files): a memfd with 2 MiB pages whenever the
    /// shmem THP policy gives them, else a 4 KiB memfd. Unlike
    /// [`Self::choose`], the cost to populate does not decide (nor does
    /// free page reporting): a page is populated once but faulted into
    /// every client, and a client's first pass over 4 KiB pages costs many
    /// times what it costs over 2 MiB ones (docs/benchmarks.md, "Figures behind the defaults").
    /// Never hugetlb: each client's private
    /// copy-on-write mapping of a hugetlb memfd reserves the whole size in
    /// the pool again, so a pool sized for the cache would refuse clients.
    pub fn choose_shared(&self) -> MemoryChoice {
        let shmem = self.thp_shmem.as_deref().unwrap_or("absent");
        if self.collapses_shared() {
            MemoryChoice {
                kind: MemoryKind::Memfd,
                reason: format!(
                    "shmem_enabled is {shmem}: cached files are loaded into 4 KiB pages, then collapsed into \
                     2 MiB pages in the background (MADV_COLLAPSE, Linux 6.1), which each client maps with a \
                     fault per 2 MiB; as root, `{SHMEM_HUGE_PAGES_HINT}` gives them 2 MiB pages from the start"
                ),
            }
        } else if self.huge_pages(MemoryKind::MemfdHuge) {
            MemoryChoice {
                kind: MemoryKind::MemfdHuge,
                reason: format!(
                    "shmem_enabled is {shmem}: cached files get 2 MiB pages, which each client maps with a \
                     fault per 2 MiB"
                ),
            }
        } else {
            MemoryChoice {
                kind: MemoryKind::Memfd,
                reason: format!(
                    "shmem_enabled is {shmem}, so cached files get 4 KiB pages, and each client's first pass \
                     over a file faults every 16 pages (about 25 times the cost of 2 MiB pages); as root, \
                     `{SHMEM_HUGE_PAGES_HINT}` gives them 2 MiB pages"
                ),
            }
        }
    }
}

/// A number field of /proc/meminfo (`kB` units left as they are).
fn meminfo_number(meminfo: &str, name: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with(name))?;
    line[name.len()..].trim().trim_end_matches("kB").trim().parse().ok()
}

/// What populating each kind cost here, recorded by `dmaload info
/// --probe-memory`: on a VM with free page reporting, cold huge pages can
/// cost more than 4 KiB ones, so `auto` goes by these figures when they
/// match the machine's kernel and THP policies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemoryProbe {
    pub kernel: String,
    pub thp_anonymous: Option<String>,
    pub thp_shmem: Option<String>,
    /// Bytes populated per kind and round.
    pub bytes: u64,
    pub rounds: usize,
    /// Seconds since the Unix epoch.
    pub recorded_at: u64,
    pub kinds: Vec<KindProbe>,
}

/// One memory kind's figures (medians over the rounds).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KindProbe {
    pub kind: MemoryKind,
    /// Wall seconds per GiB to populate (`MADV_POPULATE_WRITE`, one thread).
    pub populate_seconds_per_gib: Option<f64>,
    /// Wall seconds per GiB to unmap the populated memory.
    pub unmap_seconds_per_gib: Option<f64>,
    /// Share of the memory the kernel really backed with huge pages
    /// (/proc/self/smaps).
    pub huge_page_share: Option<f64>,
    /// Why the kind could not be measured (say, an empty hugetlb pool).
    pub error: Option<String>,
}

/// How long free page reporting takes to hand freed memory back to the
/// host: the balloon reports free blocks about 2 s after they are freed.
const REPORTING_SETTLE: std::time::Duration = std::time::Duration::from_secs(3);

/// The most bytes a recorded probe file may hold (one is about 2 KiB).
const PROBE_LIMIT: u64 = 1 << 20;

/// Where the probe's figures are kept: `$XDG_CACHE_HOME/dmaload`, else
/// `~/.cache/dmaload`.
pub fn probe_path() -> Option<PathBuf> {
    crate::user_cache::path("memory-probe.json")
}

impl MemoryProbe {
    /// Populates `bytes` of each memory kind `rounds` times (kinds
    /// interleaved, so none always runs on memory another just freed) and
    /// records the medians. Under free page reporting each sample first
    /// waits [`MemoryFacts::reporting_settle`], so it meets memory as a large load does:
    /// handed back to the host, not just freed by the sample before. A kind
    /// this machine cannot give is recorded with its reason.
    pub fn run(bytes: u64, rounds: usize) -> MemoryProbe {
        let facts = MemoryFacts::read();
        let len = usize::try_from(bytes).unwrap_or(usize::MAX).next_multiple_of(sys::mem::page_size());
        let gib = len as f64 / (1u64 << 30) as f64;
        let mut samples: Vec<Vec<(f64, f64, f64)>> = vec![Vec::new(); MemoryKind::ALL.len()];
        let mut errors: Vec<Option<String>> = vec![None; MemoryKind::ALL.len()];
        for _ in 0..rounds.max(1) {
            for (i, kind) in MemoryKind::ALL.into_iter().enumerate() {
                if errors[i].is_some() {
                    continue;
                }
                if let Some(settle) = facts.reporting_settle() {
                    std::thread::sleep(settle);
                }
                match populate_once(kind, len, &facts) {
                    Ok((populate, unmap, huge)) => samples[i].push((populate / gib, unmap / gib, huge)),
                    Err(e) => errors[i] = Some(e.to_string()),
                }
            }
        }
        let median = |v: &[(f64, f64, f64)], f: fn(&(f64, f64, f64)) -> f64| {
            let mut xs: Vec<f64> = v.iter().map(f).collect();
            xs.sort_by(f64::total_cmp);
            xs.get(xs.len() / 2).copied()
        };
        let kinds = MemoryKind::ALL
            .into_iter()
            .zip(samples.iter().zip(errors))
            .map(|(kind, (s, error))| KindProbe {
                kind,
                populate_seconds_per_gib: if error.is_some() { None } else { median(s, |x| x.0) },
                unmap_seconds_per_gib: if error.is_some() { None } else { median(s, |x| x.1) },
                huge_page_share: if error.is_some() { None } else { median(s, |x| x.2) },
                error,
            })
            .collect();
        MemoryProbe {
            kernel: facts.kernel,
            thp_anonymous: facts.thp_anonymous,
            thp_shmem: facts.thp_shmem,
            bytes: len as u64,
            rounds: rounds.max(1),
            recorded_at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            kinds,
        }
    }

    /// Whether the figures were measured under this machine's kernel and
    /// THP policies, and if not what changed.
    pub fn matches(&self, facts: &MemoryFacts) -> Result<(), String> {
        let changed = |what: &str, then: &Option<String>, now: &Option<String>| {
            format!(
                "recorded with {what} {}, now {}: run `dmaload info --probe-memory` again",
                then.as_deref().unwrap_or("absent"),
                now.as_deref().unwrap_or("absent")
            )
        };
        if self.kernel != facts.kernel {
            return Err(changed("kernel", &Some(self.kernel.clone()), &Some(facts.kernel.clone())));
        }
        if self.thp_shmem != facts.thp_shmem {
            return Err(changed("shmem_enabled", &self.thp_shmem, &facts.thp_shmem));
        }
        if self.thp_anonymous != facts.thp_anonymous {
            return Err(changed("THP enabled", &self.thp_anonymous, &facts.thp_anonymous));
        }
        if let Some(kind) =
            MemoryKind::ALL.into_iter().find(|&kind| !self.kinds.iter().any(|k| k.kind == kind))
        {
            return Err(format!(
                "recorded without {kind} memory, which this version can choose: run `dmaload info \
                 --probe-memory` again"
            ));
        }
        Ok(())
    }

    /// Writes the figures to `path` (its directory created if needed) by a
    /// temporary file renamed into place, so a reader never sees half.
    pub fn save(&self, path: &Path) -> io::Result<()> {
        crate::user_cache::replace(path, &serde_json::to_vec_pretty(self).map_err(io::Error::other)?)
    }

    /// The figures recorded at `path`; `None` when there are none. A file
    /// that does not parse (another version's, say) is an error.
    pub fn read(path: &Path) -> io::Result<Option<MemoryProbe>> {
        let Some(bytes) = crate::user_cache::read(path, PROBE_LIMIT)? else {
            return Ok(None);
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{}: {e}", path.display())))
    }
}

/// Populates `len` bytes of `kind` on this thread: (populate seconds,
/// unmap seconds, share of huge pages).
fn populate_once(kind: MemoryKind, len: usize, facts: &MemoryFacts) -> io::Result<(f64, f64, f64)> {
    let mut alloc = Allocation::with_facts(kind, len, facts)?;
    let started = Instant::now();
    let len = alloc.mapping.len();
    alloc.mapping.writer().populate(0..len)?;
    let populate = started.elapsed().as_secs_f64();
    let huge = huge_page_bytes(alloc.mapping.address(), len)? as f64 / len.max(1) as f64;
    let started = Instant::now();
    alloc.mapping.unmap_now();
    Ok((populate, started.elapsed().as_secs_f64(), huge))
}

/// Bytes of the `len` bytes mapped at `address` backed by huge pages now,
/// from /proc/self/smaps: `AnonHugePages` (anonymous THP), `ShmemPmdMapped`
/// and `FilePmdMapped` (shmem THP) and `*_Hugetlb` (hugetlb), whatever the
/// policy promised. Reading smaps walks the page tables of every mapping of
/// the process: for tests, benchmarks and the probe, not for loads.
pub fn huge_page_bytes(address: usize, len: usize) -> io::Result<u64> {
    let smaps = fs::read_to_string("/proc/self/smaps")?;
    huge_page_bytes_in(&smaps, address..address.saturating_add(len)).ok_or_else(|| {
        io::Error::new(io::ErrorKind::NotFound, format!("no mapping at {address:#x} in /proc/self/smaps"))
    })
}

/// The huge-page bytes smaps reports for the areas overlapping `range`,
/// each at most its overlap. The kernel merges an anonymous mapping with a
/// neighbour of the same flags into one area, whose figures then cover
/// both; as they share the flags, they share the page size too.
fn huge_page_bytes_in(smaps: &str, range: std::ops::Range<usize>) -> Option<u64> {
    const HUGE_FIELDS: [&str; 5] =
        ["AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:", "Shared_Hugetlb:", "Private_Hugetlb:"];
    // An area's header: "start-end perms ..." in hex.
    let area = |line: &str| {
        let (start, end) = line.split_whitespace().next()?.split_once('-')?;
        Some(usize::from_str_radix(start, 16).ok()?..usize::from_str_radix(end, 16).ok()?)
    };
    let mut total = None;
    let mut overlap = 0;
    for line in smaps.lines() {
        if let Some(found) = area(line) {
            overlap = range.end.min(found.end).saturating_sub(range.start.max(found.start));
            if overlap > 0 {
                total = Some(total.unwrap_or(0));
            }
        } else if let Some(field) = HUGE_FIELDS.iter().find(|f| line.starts_with(**f)).filter(|_| overlap > 0)
        {
            let bytes = meminfo_number(line, field).unwrap_or(0) * 1024;
            total = total.map(|t: u64| t + bytes.min(overlap as u64));
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Facts of a machine with the given policies and pool.
    fn facts(anon: &str, shmem: &str, free_pages: u64) -> MemoryFacts {
        MemoryFacts {
            thp_anonymous: Some(anon.into()),
            thp_shmem: Some(shmem.into()),
            hugetlb_page_size: 2 << 20,
            hugetlb_total_pages: free_pages + 3,
            hugetlb_free_pages: free_pages,
            free_page_reporting: false,
            file_size_limit: None,
            kernel: "6.18.0".into(),
            probe: None,
            probe_error: None,
        }
    }

    const GIB: u64 = 1 << 30;

    #[test]
    fn auto_prefers_huge_memfds_then_hugetlb_then_anonymous_thp_then_4_kib_pages() {
        let cases = [
            // anon, shmem, free 2 MiB pages, needs_fd => kind
            ("madvise", "advise", 0, true, MemoryKind::MemfdHuge),
            ("madvise", "always", 0, false, MemoryKind::MemfdHuge),
            ("never", "within_size", 512, true, MemoryKind::MemfdHuge),
            ("madvise", "force", 0, true, MemoryKind::MemfdHuge),
            ("madvise", "never", 512, true, MemoryKind::Hugetlb),
            ("madvise", "deny", 512, false, MemoryKind::Hugetlb),
            ("madvise", "never", 511, true, MemoryKind::Memfd),
            ("madvise", "never", 511, false, MemoryKind::AnonymousThp),
            ("always", "never", 0, false, MemoryKind::AnonymousThp),
            ("never", "never", 0, false, MemoryKind::Anonymous),
            ("madvise", "never", 0, true, MemoryKind::Memfd),
        ];
        for (anon, shmem, free, needs_fd, want) in cases {
            let choice = facts(anon, shmem, free).choose(GIB, needs_fd);
            assert_eq!(choice.kind, want, "{anon} {shmem} {free} {needs_fd}: {}", choice.reason);
            assert!(!choice.reason.is_empty());
        }
        let none = MemoryFacts::default().choose(GIB, false);
        assert_eq!(none.kind, MemoryKind::Anonymous, "{}", none.reason);
        assert_eq!(MemoryFacts::default().choose(GIB, true).kind, MemoryKind::Memfd);
    }

    #[test]
    fn shared_memory_takes_huge_memfds_whenever_the_policy_allows_and_never_hugetlb() {
        for (shmem, reporting, want) in [
            ("advise", false, MemoryKind::MemfdHuge),
            ("within_size", true, MemoryKind::MemfdHuge),
            ("never", false, MemoryKind::Memfd),
            ("deny", true, MemoryKind::Memfd),
        ] {
            let mut f = MemoryFacts { free_page_reporting: reporting, ..facts("madvise", shmem, 4096) };
            // A probe saying 4 KiB pages populate faster does not decide here.
            f.probe =
                Some(probe_of(&f, &[(MemoryKind::Memfd, Some(0.1)), (MemoryKind::MemfdHuge, Some(0.9))]));
            let choice = f.choose_shared();
            assert_eq!(choice.kind, want, "{shmem} {reporting}: {}", choice.reason);
            if want == MemoryKind::Memfd {
                assert!(choice.reason.contains(SHMEM_HUGE_PAGES_HINT), "{}", choice.reason);
            }
            // 4 KiB pages are collapsed afterwards unless the policy denies it.
            assert_eq!(f.collapses_shared(), shmem == "never", "{shmem}");
            assert_eq!(choice.reason.contains("MADV_COLLAPSE"), shmem == "never", "{}", choice.reason);
        }
    }

    #[test]
    fn unreadable_probe_figures_are_said_not_ignored() {
        let f = MemoryFacts {
            probe_error: Some("probe.json: expected value".into()),
            ..facts("never", "never", 0)
        };
        let choice = f.choose(GIB, true);
        assert_eq!(choice.kind, MemoryKind::Memfd);
        assert!(choice.reason.contains("unreadable: probe.json: expected value"), "{}", choice.reason);
    }

    #[test]
    fn a_file_size_limit_below_the_load_rules_out_memfds() {
        let f = MemoryFacts { file_size_limit: Some(GIB - 1), ..facts("never", "advise", 1024) };
        for kind in [MemoryKind::Memfd, MemoryKind::MemfdHuge, MemoryKind::Hugetlb] {
            assert!(f.can_give(kind, GIB).unwrap_err().contains("RLIMIT_FSIZE"), "{kind}");
            assert!(f.can_give(kind, GIB - 1).is_ok(), "{kind}");
        }
        let choice = f.choose(GIB, false);
        assert_eq!(choice.kind, MemoryKind::Anonymous, "{}", choice.reason);
        assert!(choice.reason.contains("RLIMIT_FSIZE"), "{}", choice.reason);
        // Needing an fd, the load gets a memfd and its clear error.
        assert_eq!(f.choose(GIB, true).kind, MemoryKind::Memfd);
    }

    #[test]
    fn under_free_page_reporting_the_rule_leaves_out_transparent_huge_pages() {
        for (shmem, free, needs_fd, want) in [
            ("advise", 0, true, MemoryKind::Memfd),
            ("advise", 0, false, MemoryKind::Anonymous),
            ("never", 0, false, MemoryKind::Anonymous),
            // The hugetlb pool is never reported: it stays.
            ("advise", 512, true, MemoryKind::Hugetlb),
        ] {
            let f = MemoryFacts { free_page_reporting: true, ..facts("madvise", shmem, free) };
            let choice = f.choose(GIB, needs_fd);
            assert_eq!(choice.kind, want, "{shmem} {free} {needs_fd}: {}", choice.reason);
            if want != MemoryKind::Hugetlb {
                assert!(choice.reason.contains("free page reporting is on"), "{}", choice.reason);
            }
        }
        // Measured figures decide, reporting or not.
        let mut f = MemoryFacts { free_page_reporting: true, ..facts("madvise", "advise", 0) };
        f.probe = Some(probe_of(&f, &[(MemoryKind::Memfd, Some(0.5)), (MemoryKind::MemfdHuge, Some(0.2))]));
        assert_eq!(f.choose(GIB, true).kind, MemoryKind::MemfdHuge);
    }

    #[test]
    fn kinds_the_kernel_cannot_give_say_what_would_change_it() {
        let f = facts("madvise", "never", 10);
        let why = f.can_give(MemoryKind::MemfdHuge, GIB).unwrap_err();
        assert!(why.contains("never") && why.contains(SHMEM_HUGE_PAGES_HINT), "{why}");
        let why = f.can_give(MemoryKind::Hugetlb, GIB).unwrap_err();
        // 512 pages needed, 10 free of 13: the pool must grow to 515.
        assert!(why.contains("10 free") && why.contains("512 needed") && why.contains("echo 515 >"), "{why}");
        assert!(f.can_give(MemoryKind::Hugetlb, 20 << 20).is_ok());
        assert!(
            f.can_give(MemoryKind::Memfd, GIB).is_ok() && f.can_give(MemoryKind::AnonymousThp, GIB).is_ok()
        );
        let no_hugetlb = MemoryFacts { hugetlb_page_size: 0, ..f.clone() };
        assert!(no_hugetlb.can_give(MemoryKind::Hugetlb, 1).unwrap_err().contains("no hugetlb"));
        assert_eq!(f.huge_pages_hint(), Some(SHMEM_HUGE_PAGES_HINT));
        assert_eq!(facts("madvise", "advise", 0).huge_pages_hint(), None);
    }

    /// A probe with `costs` (`None`: the kind could not be measured) and
    /// every other kind unmeasurable.
    fn probe_of(f: &MemoryFacts, costs: &[(MemoryKind, Option<f64>)]) -> MemoryProbe {
        let unmeasured = MemoryKind::ALL.into_iter().filter(|&k| !costs.iter().any(|c| c.0 == k));
        let costs: Vec<(MemoryKind, Option<f64>)> =
            costs.iter().copied().chain(unmeasured.map(|k| (k, None))).collect();
        MemoryProbe {
            kernel: f.kernel.clone(),
            thp_anonymous: f.thp_anonymous.clone(),
            thp_shmem: f.thp_shmem.clone(),
            bytes: 256 << 20,
            rounds: 3,
            recorded_at: 0,
            kinds: costs
                .iter()
                .map(|&(kind, cost)| KindProbe {
                    kind,
                    populate_seconds_per_gib: cost,
                    unmap_seconds_per_gib: cost.map(|c| c / 10.0),
                    huge_page_share: Some(1.0),
                    error: cost.is_none().then(|| "pool empty".into()),
                })
                .collect(),
        }
    }

    #[test]
    fn recorded_figures_pick_the_cheapest_usable_kind() {
        use MemoryKind::*;
        let mut f = facts("madvise", "advise", 0);
        // Cold huge pages slower than 4 KiB ones (free page reporting).
        f.probe =
            Some(probe_of(&f, &[(Memfd, Some(0.4)), (MemfdHuge, Some(0.9)), (AnonymousThp, Some(0.2))]));
        let shared = f.choose(GIB, true);
        assert_eq!(shared.kind, Memfd, "{}", shared.reason);
        assert!(shared.reason.contains("memfd 0.400 s/GiB") && shared.reason.contains("--probe-memory"));
        assert_eq!(f.choose(GIB, false).kind, AnonymousThp);
        // hugetlb measured cheapest but the pool is empty now: not usable.
        f.probe = Some(probe_of(&f, &[(Hugetlb, Some(0.1)), (Memfd, Some(0.4)), (MemfdHuge, Some(0.3))]));
        assert_eq!(f.choose(GIB, true).kind, MemfdHuge);
        // Nothing usable measured: the rule.
        f.probe = Some(probe_of(&f, &[(Hugetlb, None)]));
        assert_eq!(f.choose(GIB, true).kind, MemfdHuge);
    }

    #[test]
    fn figures_from_another_policy_are_ignored_and_the_reason_says_so() {
        let mut f = facts("madvise", "advise", 0);
        let mut probe = probe_of(&f, &[(MemoryKind::Memfd, Some(0.1)), (MemoryKind::MemfdHuge, Some(0.9))]);
        probe.thp_shmem = Some("never".into());
        f.probe = Some(probe);
        let choice = f.choose(GIB, true);
        assert_eq!(choice.kind, MemoryKind::MemfdHuge);
        assert!(choice.reason.contains("recorded with shmem_enabled never, now advise"), "{}", choice.reason);
        // Figures recorded before a kind existed cannot rank it: ignored.
        let mut f = facts("madvise", "never", 0);
        let mut probe = probe_of(&f, &[(MemoryKind::Memfd, Some(0.1))]);
        probe.kinds.retain(|k| k.kind != MemoryKind::Anonymous);
        f.probe = Some(probe);
        let choice = f.choose(GIB, false);
        assert_eq!(choice.kind, MemoryKind::AnonymousThp, "the rule's choice, not the figures'");
        assert!(choice.reason.contains("recorded without anonymous memory"), "{}", choice.reason);
    }

    #[test]
    fn probe_figures_round_trip_through_a_cache_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dmaload").join("memory-probe.json");
        assert_eq!(MemoryProbe::read(&path).unwrap(), None);
        let f = facts("madvise", "never", 0);
        let probe = probe_of(&f, &[(MemoryKind::Memfd, Some(0.5)), (MemoryKind::Hugetlb, None)]);
        probe.save(&path).unwrap();
        assert_eq!(MemoryProbe::read(&path).unwrap(), Some(probe));
        assert_eq!(fs::read_dir(path.parent().unwrap()).unwrap().count(), 1, "no temporary file left");
        fs::write(&path, "{not json").unwrap();
        assert_eq!(MemoryProbe::read(&path).unwrap_err().kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn smaps_huge_page_fields_are_summed_for_one_mapping() {
        let smaps = "\
7f0000000000-7f0040000000 rw-s 00000000 00:01 12 /memfd:dmaload (deleted)
Size:            1048576 kB
Rss:             1048576 kB
AnonHugePages:         0 kB
ShmemPmdMapped:   1044480 kB
FilePmdMapped:         0 kB
Shared_Hugetlb:        0 kB
VmFlags: rd wr sh mr mw me ms sd hg
7f0040000000-7f0040200000 rw-p 00000000 00:00 0
AnonHugePages:      2048 kB
";
        assert_eq!(huge_page_bytes_in(smaps, 0x7f00_0000_0000..0x7f00_4000_0000), Some(1044480 * 1024));
        assert_eq!(huge_page_bytes_in(smaps, 0x7f00_4000_0000..0x7f00_4020_0000), Some(2048 * 1024));
        assert_eq!(huge_page_bytes_in(smaps, 0x1000..0x2000), None);
        // A buffer inside an area merged with its neighbour: at most its own bytes.
        assert_eq!(huge_page_bytes_in(smaps, 0x7f00_0010_0000..0x7f00_0030_0000), Some(2 << 20));
        // One spanning both areas: each area's figure.
        assert_eq!(
            huge_page_bytes_in(smaps, 0x7f00_0000_0000..0x7f00_4020_0000),
            Some((1044480 + 2048) * 1024)
        );
    }
}
