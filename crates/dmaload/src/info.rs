//! What `dmaload info` shows: the kernel's io_uring, memlock, THP and
//! hugetlb settings, which memory `auto` chooses and why, dma-heaps and
//! udmabuf, the CUDA driver, and for a path its filesystem, direct-I/O
//! alignment and device queue. Gathered from every layer below, so it sits
//! on top of them.

use std::fs;
use std::io;
use std::os::fd::AsFd;
use std::path::Path;

use serde::Serialize;

use crate::memory::{MemoryChoice, MemoryFacts, MemoryProbe};
use crate::sys;
use crate::system::{
    bracketed_choice, filesystem_name, free_page_reporting, memlock_exempt, memory_available, DeviceQueue,
    THP_ANONYMOUS, THP_SHMEM,
};

/// The capabilities report printed by `dmaload info`.
#[derive(Debug, Serialize)]
pub struct SystemInfo {
    pub kernel: String,
    pub io_uring: Result<sys::uring::UringProbe, String>,
    /// Soft RLIMIT_MEMLOCK in bytes; `None` = unlimited.
    pub memlock_limit: Option<u64>,
    /// Whether pinned memory is exempt from RLIMIT_MEMLOCK (CAP_IPC_LOCK).
    pub memlock_exempt: bool,
    pub thp_anonymous: Option<String>,
    pub thp_shmem: Option<String>,
    /// The default huge page size and the hugetlb pool's unreserved free
    /// pages.
    pub hugetlb_page_size: u64,
    pub hugetlb_free_pages: u64,
    /// What `to: auto` gives a 1 GiB load that needs an fd (the default),
    /// and one that does not (`needs_fd: false`, a CLI load).
    pub auto_shareable: MemoryChoice,
    pub auto_private: MemoryChoice,
    /// The sysfs line an administrator could run so memfds get huge pages;
    /// `None` where they already do.
    pub huge_pages_hint: Option<&'static str>,
    /// Where `dmaload info --probe-memory` keeps its figures, and them.
    pub memory_probe_path: Option<String>,
    pub memory_probe: Option<MemoryProbe>,
    pub memory_available: Option<u64>,
    pub dma_heaps: Vec<String>,
    pub udmabuf: bool,
    pub udmabuf_size_limit_mb: Option<u64>,
    /// Set when a virtio balloon reports free memory to the hypervisor: the
    /// size in bytes of the smallest free block handed back.
    pub free_page_reporting: Option<u64>,
    /// CUDA devices for `--to cuda:N`: the driver and each device's name,
    /// or why there are none (no libcuda.so.1, no device, ...).
    pub cuda: Result<String, String>,
    pub path: Option<PathInfo>,
}

/// "driver 13.0: cuda:0 NVIDIA H100 80GB HBM3, ..." from the driver API
/// (loaded at run time), or why CUDA is unusable here.
fn cuda_summary() -> Result<String, String> {
    use crate::cuda::{device_count, driver_version, Context};
    let version = driver_version().map_err(|e| e.to_string())?;
    let devices: Vec<String> = (0..device_count().map_err(|e| e.to_string())?)
        .map(|n| {
            let name = Context::primary(n).and_then(|ctx| ctx.device_name());
            format!("cuda:{n} {}", name.unwrap_or_else(|e| e.to_string()))
        })
        .collect();
    Ok(format!("driver {}.{}: {}", version / 1000, version % 1000 / 10, devices.join(", ")))
}

/// Facts about one file or directory that decide how it can be read.
#[derive(Debug, Serialize)]
pub struct PathInfo {
    pub path: String,
    pub filesystem: String,
    pub filesystem_magic: String,
    /// `statx(STATX_DIOALIGN)`: memory and offset alignment for O_DIRECT.
    pub direct_io: DirectIoInfo,
    pub rwf_dontcache: Option<bool>,
    /// The request limits of the block device under it, where there is one.
    pub device_queue: Option<DeviceQueue>,
}

#[derive(Debug, Serialize)]
#[serde(tag = "status", rename_all = "kebab-case")]
pub enum DirectIoInfo {
    Supported { memory_align: u32, offset_align: u32 },
    Unsupported,
    Unknown { reason: String },
}

/// Gathers everything `dmaload info` shows; `path` adds per-file facts.
pub fn system_info(path: Option<&Path>) -> io::Result<SystemInfo> {
    let dma_heaps = match fs::read_dir("/dev/dma_heap") {
        Ok(dir) => {
            let mut names: Vec<String> =
                dir.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into()).collect();
            names.sort();
            names
        }
        Err(_) => Vec::new(),
    };
    let udmabuf_size_limit_mb = fs::read_to_string("/sys/module/udmabuf/parameters/size_limit_mb")
        .ok()
        .and_then(|s| s.trim().parse().ok());
    let facts = MemoryFacts::read();
    const GIB: u64 = 1 << 30;
    Ok(SystemInfo {
        kernel: sys::process::kernel_release()?,
        io_uring: sys::uring::probe().map_err(|e| e.to_string()),
        memlock_limit: sys::process::memlock_limit()?,
        memlock_exempt: memlock_exempt(),
        thp_anonymous: bracketed_choice(THP_ANONYMOUS),
        thp_shmem: bracketed_choice(THP_SHMEM),
        hugetlb_page_size: facts.hugetlb_page_size,
        hugetlb_free_pages: facts.hugetlb_free_pages,
        auto_shareable: facts.choose(GIB, true),
        auto_private: facts.choose(GIB, false),
        huge_pages_hint: facts.huge_pages_hint(),
        memory_probe_path: crate::memory::probe_path().map(|p| p.display().to_string()),
        memory_probe: facts.probe.clone(),
        memory_available: memory_available().ok(),
        dma_heaps,
        udmabuf: Path::new("/dev/udmabuf").exists(),
        udmabuf_size_limit_mb,
        free_page_reporting: free_page_reporting(),
        cuda: cuda_summary(),
        path: path.map(path_info).transpose()?,
    })
}

fn path_info(path: &Path) -> io::Result<PathInfo> {
    // A directory tells what its filesystem can do; any other path must be
    // something a load could open (a FIFO would block an open forever).
    let file = if fs::metadata(path)?.is_dir() {
        fs::File::open(path)?
    } else {
        crate::source::open_for_reading(path)?
    };
    let magic = sys::file::filesystem_magic(file.as_fd())?;
    let direct_io = match sys::file::statx_dio_align(file.as_fd()) {
        Ok(sys::file::DioAlignQuery::Supported(a)) => {
            DirectIoInfo::Supported { memory_align: a.memory, offset_align: a.offset }
        }
        Ok(sys::file::DioAlignQuery::Unsupported) => DirectIoInfo::Unsupported,
        Ok(sys::file::DioAlignQuery::Unknown) => {
            DirectIoInfo::Unknown { reason: "kernel or filesystem does not report STATX_DIOALIGN".into() }
        }
        Err(e) => DirectIoInfo::Unknown { reason: format!("statx failed: {e}") },
    };
    let meta = file.metadata()?;
    let rwf_dontcache = if meta.is_file() { Some(sys::file::supports_dontcache(file.as_fd())) } else { None };
    Ok(PathInfo {
        path: path.display().to_string(),
        filesystem: filesystem_name(magic).into(),
        filesystem_magic: format!("{magic:#x}"),
        direct_io,
        rwf_dontcache,
        device_queue: DeviceQueue::of(&meta),
    })
}
