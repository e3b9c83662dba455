//! What this machine can do, read from /proc, /sys and /dev (no unsafe):
//! the facts behind `dmaload info` and the loader's up-front checks.

use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};

use serde::Serialize;

use crate::sys;

pub use crate::sys::process::past_file_size_limit;

/// User and system CPU time of this process so far, every thread's
/// (joined ones and io_uring workers included): `getrusage(RUSAGE_SELF)`.
pub fn cpu_time() -> io::Result<(std::time::Duration, std::time::Duration)> {
    sys::process::cpu_time()
}

/// Bytes this process can allocate without swapping or meeting its memory
/// cgroup's limit: the smaller of `MemAvailable` in /proc/meminfo (Linux
/// 3.14) and [`cgroup_memory_headroom`].
pub fn memory_available() -> io::Result<u64> {
    Ok(memory_budget()?.available)
}

/// How much memory a load may use, and what limits it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryBudget {
    pub available: u64,
    /// What sets `available`, in words for an error message.
    pub limited_by: String,
}

/// [`memory_available`], with what limits it.
pub fn memory_budget() -> io::Result<MemoryBudget> {
    let meminfo = fs::read_to_string("/proc/meminfo")?;
    let system = meminfo_field(&meminfo, "MemAvailable:")
        .ok_or_else(|| io::Error::other("no MemAvailable in /proc/meminfo"))?;
    let system = MemoryBudget { available: system, limited_by: "MemAvailable in /proc/meminfo".into() };
    Ok(match cgroup_memory_headroom() {
        Some(cgroup) if cgroup.available < system.available => cgroup,
        _ => system,
    })
}

/// [`memory_budget`] for a load that needs `needed` bytes: when that is
/// more than is available and buffers dropped a moment ago are still being
/// unmapped in the background, waits for them first, so memory a caller
/// has just freed counts as free.
pub fn memory_budget_for(needed: u64) -> io::Result<MemoryBudget> {
    let budget = memory_budget()?;
    if needed <= budget.available || sys::mem::unmap_pending() == 0 {
        return Ok(budget);
    }
    sys::mem::wait_for_unmaps();
    memory_budget()
}

/// The memory this process's cgroup (v2 `memory.max`, or v1
/// `memory.limit_in_bytes`) and each of its ancestors still allow: the
/// limit less the usage, where page cache that is not shmem counts as free
/// (the kernel reclaims it before it fails an allocation). `None` where no
/// memory cgroup limits the process.
pub fn cgroup_memory_headroom() -> Option<MemoryBudget> {
    let membership = fs::read_to_string("/proc/self/cgroup").ok()?;
    let mounts = fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mut best: Option<MemoryBudget> = None;
    for line in membership.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (fields.next(), fields.next(), fields.next()) else {
            continue;
        };
        let v2 = controllers.is_empty();
        if !v2 && !controllers.split(',').any(|c| c == "memory") {
            continue;
        }
        let Some(mount) = cgroup_mount(&mounts, v2) else { continue };
        let (limit_file, usage_file) = if v2 {
            ("memory.max", "memory.current")
        } else {
            ("memory.limit_in_bytes", "memory.usage_in_bytes")
        };
        let mut dir = mount.join(path.trim_start_matches('/'));
        loop {
            let read = |name: &str| fs::read_to_string(dir.join(name)).ok();
            // "max" (v2) or a page-rounded i64::MAX (v1): no limit at this level.
            let limit = read(limit_file).and_then(|l| l.trim().parse::<u64>().ok()).filter(|&l| l < 1 << 62);
            if let (Some(limit), Some(usage)) =
                (limit, read(usage_file).and_then(|u| u.trim().parse::<u64>().ok()))
            {
                let stat = read("memory.stat").unwrap_or_default();
                let field = |name: &str| stat_field(&stat, name).unwrap_or(0);
                let reclaimable = if v2 {
                    field("file").saturating_sub(field("shmem"))
                } else {
                    field("total_cache").saturating_sub(field("total_shmem"))
                };
                let available = limit.saturating_sub(usage.saturating_sub(reclaimable));
                if best.as_ref().map_or(true, |b| available < b.available) {
                    best = Some(MemoryBudget {
                        available,
                        limited_by: format!(
                            "the memory cgroup {}: {limit_file} {limit} bytes, {usage} in use",
                            dir.display()
                        ),
                    });
                }
            }
            if dir == mount || !dir.pop() || !dir.starts_with(&mount) {
                break;
            }
        }
    }
    best
}

/// Where the cgroup v2 hierarchy, or the v1 memory controller, is mounted.
fn cgroup_mount(mountinfo: &str, v2: bool) -> Option<std::path::PathBuf> {
    mountinfo.lines().find_map(|line| {
        // "ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS ... - FSTYPE SOURCE SUPEROPTIONS"
        let (left, right) = line.split_once(" - ")?;
        let mountpoint = left.split(' ').nth(4)?;
        let mut right = right.split(' ');
        let fstype = right.next()?;
        let super_options = right.nth(1).unwrap_or("");
        let wanted = if v2 {
            fstype == "cgroup2"
        } else {
            fstype == "cgroup" && super_options.split(',').any(|o| o == "memory")
        };
        wanted.then(|| std::path::PathBuf::from(mountpoint))
    })
}

fn stat_field(stat: &str, name: &str) -> Option<u64> {
    stat.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

fn meminfo_field(meminfo: &str, name: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with(name))?;
    let kib: u64 = line[name.len()..].trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib * 1024)
}

pub(crate) const THP_ANONYMOUS: &str = "/sys/kernel/mm/transparent_hugepage/enabled";
pub(crate) const THP_SHMEM: &str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";

/// The selected value of a THP setting file such as
/// /sys/kernel/mm/transparent_hugepage/enabled (`always [madvise] never`).
pub(crate) fn bracketed_choice(path: &str) -> Option<String> {
    let text = fs::read_to_string(path).ok()?;
    let start = text.find('[')? + 1;
    let end = text[start..].find(']')? + start;
    Some(text[start..end].to_owned())
}

/// Names filesystem magic numbers (`statfs.f_type`) dmaload cares about.
pub fn filesystem_name(magic: i64) -> &'static str {
    match magic {
        0xEF53 => "ext4",
        0x58465342 => "xfs",
        0x9123683E => "btrfs",
        0xF2F52010 => "f2fs",
        0x01021994 => "tmpfs",
        0x858458F6 => "ramfs",
        0x794C7630 => "overlayfs",
        0x65735546 => "fuse",
        0x6969 => "nfs",
        0xE0F5E1E2 => "erofs",
        0x73717368 => "squashfs",
        0x2FC12FC1 => "zfs",
        0xFF534D42 => "cifs",
        0x6E667364 => "nfsd",
        _ => "other",
    }
}

/// The name of a filesystem whose files are generated when read (procfs,
/// sysfs, ...): their `st_size` is 0 or a page, not their length.
pub fn pseudo_filesystem_name(magic: i64) -> Option<&'static str> {
    Some(match magic {
        0x9fa0 => "procfs",
        0x62656572 => "sysfs",
        0x64626720 => "debugfs",
        0x74726163 => "tracefs",
        0x62656570 => "configfs",
        0x73636673 => "securityfs",
        0x63677270 => "cgroup2",
        0x27e0eb => "cgroup",
        0xcafe4a11 => "bpf",
        0x6165676c => "pstore",
        0xde5e81e4 => "efivarfs",
        _ => return None,
    })
}

/// Whether a filesystem keeps its files in the page cache itself (tmpfs,
/// ramfs): O_DIRECT there still copies from that cache, and evicting it
/// would delete the data.
pub fn is_memory_filesystem(magic: i64) -> bool {
    matches!(filesystem_name(magic), "tmpfs" | "ramfs")
}

/// The request limits of the block device under a file, from its queue in
/// sysfs: a direct read that needs more bytes, or more scatter-gather
/// entries, than one request holds is split into several requests.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceQueue {
    /// The device's name in sysfs (the whole disk's, for a partition).
    pub device: String,
    /// Scatter-gather entries one request holds (`queue/max_segments`).
    pub max_segments: u64,
    /// Bytes one request carries (`queue/max_sectors_kb`).
    pub max_request_bytes: u64,
    /// Bytes one entry covers (`queue/max_segment_size`).
    pub max_segment_bytes: u64,
}

impl DeviceQueue {
    /// The queue of the block device a file with these metadata lives on
    /// (or is, for a device node); `None` where there is none to read, as
    /// for a filesystem not on one block device (btrfs, overlayfs, NFS).
    pub fn of(meta: &fs::Metadata) -> Option<DeviceQueue> {
        let dev = if meta.file_type().is_block_device() { meta.rdev() } else { meta.dev() };
        let (major, minor) = sys::file::device_numbers(dev);
        let node = fs::canonicalize(format!("/sys/dev/block/{major}:{minor}")).ok()?;
        // A partition has no queue of its own: its disk's applies.
        let disk = if node.join("partition").exists() { node.parent()?.to_owned() } else { node };
        let read = |name: &str| -> Option<u64> {
            fs::read_to_string(disk.join("queue").join(name)).ok()?.trim().parse().ok()
        };
        Some(DeviceQueue {
            device: disk.file_name()?.to_string_lossy().into_owned(),
            max_segments: read("max_segments")?,
            max_request_bytes: read("max_sectors_kb")?.checked_mul(1024)?,
            max_segment_bytes: read("max_segment_size")?,
        })
    }

    /// Requests the device needs for one direct read of `len` bytes into
    /// pages of `page` bytes, none physically next to another (so each
    /// takes an entry of its own, as freshly allocated pages may).
    pub fn requests(&self, len: u64, page: u64) -> u64 {
        let per_entry = page.min(self.max_segment_bytes).max(1);
        let per_request = self.max_request_bytes.min(self.max_segments.saturating_mul(per_entry)).max(1);
        len.div_ceil(per_request)
    }
}

/// The smallest free block (bytes) a virtio balloon with free page
/// reporting (`VIRTIO_BALLOON_F_REPORTING`, feature bit 5) hands back to the
/// host, or `None` where no such device is bound. Memory in such blocks
/// costs a host fault and zeroing again when reused, which makes huge pages
/// and memory-hungry benchmark runs slow after the machine idles.
pub fn free_page_reporting() -> Option<u64> {
    const VIRTIO_BALLOON_F_REPORTING: usize = 5;
    let devices = fs::read_dir("/sys/bus/virtio/drivers/virtio_balloon").ok()?;
    let reporting = devices.flatten().any(|entry| {
        fs::read_to_string(entry.path().join("features"))
            .is_ok_and(|bits| bits.as_bytes().get(VIRTIO_BALLOON_F_REPORTING) == Some(&b'1'))
    });
    if !reporting {
        return None;
    }
    let order: u32 = fs::read_to_string("/sys/module/page_reporting/parameters/page_reporting_order")
        .ok()
        .and_then(|s| s.trim().parse().ok())?;
    (sys::mem::page_size() as u64).checked_shl(order)
}

/// Whether the process's effective capabilities include CAP_IPC_LOCK
/// (bit 14 of CapEff in /proc/self/status).
fn has_cap_ipc_lock() -> bool {
    let Ok(status) = fs::read_to_string("/proc/self/status") else { return false };
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << 14) != 0)
}

/// Whether pages pinned by io_uring buffer registration can exceed the
/// memlock limit: true with CAP_IPC_LOCK or an unlimited limit.
pub fn memlock_exempt() -> bool {
    has_cap_ipc_lock() || matches!(sys::process::memlock_limit(), Ok(None))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_parses_kib() {
        let text = "MemTotal:       24000000 kB\nMemAvailable:    1024 kB\n";
        assert_eq!(meminfo_field(text, "MemAvailable:"), Some(1024 * 1024));
        assert_eq!(meminfo_field(text, "Missing:"), None);
    }

    fn queue(max_segments: u64, max_request_kib: u64, max_segment_bytes: u64) -> DeviceQueue {
        DeviceQueue {
            device: "test".into(),
            max_segments,
            max_request_bytes: max_request_kib << 10,
            max_segment_bytes,
        }
    }

    #[test]
    fn a_read_is_split_by_whichever_request_limit_it_meets_first() {
        const READ: u64 = 4 << 20;
        let (small, huge) = (4096, 2 << 20);
        // The development VM's virtio disk: entries bound 4 KiB pages, bytes bound huge ones.
        let virtio = queue(254, 4096, u32::MAX.into());
        assert_eq!((virtio.requests(READ, small), virtio.requests(READ, huge)), (5, 1));
        // NVMe with a small transfer size: bytes bound both.
        let nvme = queue(127, 128, u32::MAX.into());
        assert_eq!((nvme.requests(READ, small), nvme.requests(READ, huge)), (32, 32));
        // AHCI: 64 KiB entries, so a huge page takes 32 of them.
        let ahci = queue(168, 1280, 64 << 10);
        assert_eq!((ahci.requests(READ, small), ahci.requests(READ, huge)), (7, 4));
        assert_eq!(virtio.requests(1, small), 1);
        assert_eq!(queue(0, 0, 0).requests(READ, small), READ, "zeros read from sysfs never divide by zero");
    }

    #[test]
    fn the_queue_is_read_for_a_file_on_a_disk_and_none_for_one_in_memory() {
        let exe = fs::metadata("/proc/self/exe").unwrap();
        match DeviceQueue::of(&exe) {
            Some(q) => {
                assert!(!q.device.is_empty() && q.max_segments >= 1, "{q:?}");
                assert!(q.max_request_bytes >= 4096 && q.max_segment_bytes >= 4096, "{q:?}");
            }
            None => eprintln!("skipped: this test binary is not on a block device with a queue in sysfs"),
        }
        let shm = tempfile::NamedTempFile::new_in("/dev/shm").unwrap();
        assert_eq!(DeviceQueue::of(&shm.as_file().metadata().unwrap()), None, "tmpfs has no device");
    }
}
