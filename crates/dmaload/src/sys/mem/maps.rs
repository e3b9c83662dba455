//! Reading `/proc/self/maps`: whether a range is still mapped from a
//! given file, after a move that may have failed.

use std::io;
use std::ops::Range;
use std::os::fd::{AsRawFd, BorrowedFd};

use super::check;

/// Whether `range` is covered, without a gap, by shared mappings of
/// `fd`'s file at the offsets of their distance from `range.start`: the
/// shared mapping from offset 0 that [`Mapping::shared`](super::Mapping::shared) made there (or
/// pieces of it), as `/proc/self/maps` lists it. Another mapping put there
/// would be of another file, private, or at other offsets, unless someone
/// else mapped this very file the same way: the same pages in the same
/// places.
pub(super) fn maps_file_from_start(range: Range<usize>, fd: BorrowedFd<'_>) -> io::Result<bool> {
    let (device, inode) = file_identity(fd)?;
    let device = crate::sys::file::device_numbers(device);
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    let mut covered = range.start;
    for line in maps.lines() {
        let vma = MapsLine::parse(line)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("unexpected line {line:?}")))?;
        if vma.end <= covered || vma.start >= range.end {
            continue;
        }
        let ours = vma.start == covered
            && vma.shared
            && (vma.device, vma.inode) == (device, inode)
            && vma.offset == (vma.start - range.start) as u64;
        if !ours {
            return Ok(false);
        }
        covered = vma.end;
        if covered >= range.end {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The fields of a `/proc/self/maps` line that [`maps_file_from_start`]
/// compares.
pub(super) struct MapsLine {
    start: usize,
    end: usize,
    shared: bool,
    offset: u64,
    device: (u32, u32),
    inode: u64,
}

impl MapsLine {
    /// `start-end perms offset major:minor inode [path]`, numbers in hex
    /// but the inode.
    fn parse(line: &str) -> Option<MapsLine> {
        let mut fields = line.split_ascii_whitespace();
        let (start, end) = fields.next()?.split_once('-')?;
        let perms = fields.next()?;
        let offset = fields.next()?;
        let (major, minor) = fields.next()?.split_once(':')?;
        Some(MapsLine {
            start: usize::from_str_radix(start, 16).ok()?,
            end: usize::from_str_radix(end, 16).ok()?,
            shared: perms.as_bytes().get(3) == Some(&b's'),
            offset: u64::from_str_radix(offset, 16).ok()?,
            device: (u32::from_str_radix(major, 16).ok()?, u32::from_str_radix(minor, 16).ok()?),
            inode: fields.next()?.parse().ok()?,
        })
    }
}

/// The device and inode numbers of `fd`'s file (`fstat`).
pub(super) fn file_identity(fd: BorrowedFd<'_>) -> io::Result<(u64, u64)> {
    let mut stat = std::mem::MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: `stat` is a writable struct stat the kernel fills.
    check(unsafe { libc::fstat(fd.as_raw_fd(), stat.as_mut_ptr()) })?;
    // SAFETY: filled by a successful fstat.
    let stat = unsafe { stat.assume_init() };
    Ok((stat.st_dev, stat.st_ino))
}
