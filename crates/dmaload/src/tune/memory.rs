//! The memory file (`$XDG_CACHE_HOME/dmaload/tuning`): one line per block
//! device, what its reads were tuned to, and one per object store
//! endpoint, what its GETs were tuned to.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use crate::sys;

use super::climb::{MAX_CONNECTIONS, MAX_DEPTH, MAX_REQUEST, MIN_CONNECTIONS, MIN_DEPTH, MIN_REQUEST};

/// The memory file is this small; a larger one is not ours to trust.
const MEMORY_LIMIT: u64 = 64 << 10;
/// The key of an endpoint's line begins with this word (a device's is
/// `MAJOR:MINOR`).
const ENDPOINT_PREFIX: &str = "s3 ";

/// How an `auto` load's file reads go (see [`super`]'s comment).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReadMode {
    /// O_DIRECT.
    Direct,
    /// Through the page cache (with `RWF_DONTCACHE` where the filesystem
    /// has it: the engine's choice, [`crate::engine::ReadModes`]).
    Buffered,
}

impl ReadMode {
    pub fn name(self) -> &'static str {
        match self {
            ReadMode::Direct => "direct",
            ReadMode::Buffered => "buffered",
        }
    }

    fn parse(word: &str) -> Option<ReadMode> {
        [ReadMode::Direct, ReadMode::Buffered].into_iter().find(|mode| mode.name() == word)
    }

    pub(super) fn other(self) -> ReadMode {
        match self {
            ReadMode::Direct => ReadMode::Buffered,
            ReadMode::Buffered => ReadMode::Direct,
        }
    }
}

/// The read mode a device's measurement kept, and the rate (bytes per
/// second) of its slower window then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RememberedRead {
    pub mode: ReadMode,
    pub rate: u64,
}

/// A block device, by its numbers: what a depth is remembered for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Device {
    major: u32,
    minor: u32,
}

impl Device {
    /// The device `file` is read from: itself for a block device, else the
    /// one holding its filesystem.
    pub fn of(file: &File) -> io::Result<Device> {
        let meta = file.metadata()?;
        let dev = if meta.file_type().is_block_device() { meta.rdev() } else { meta.dev() };
        let (major, minor) = sys::file::device_numbers(dev);
        Ok(Device { major, minor })
    }

    fn key(&self) -> String {
        format!("{}:{}", self.major, self.minor)
    }
}

/// Where depths are remembered (see [`crate::user_cache::path`]).
pub(crate) fn memory_file() -> Option<PathBuf> {
    crate::user_cache::path("tuning")
}

/// What a device's reads were tuned to: the depth and the request size
/// where a load measured them (a line without one keeps the options'
/// depth or the plan's chunk), and the read mode where an `auto` load
/// measured one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Remembered {
    pub depth: Option<usize>,
    pub request: Option<usize>,
    pub read: Option<RememberedRead>,
}

/// One `MAJOR:MINOR[ queue_depth=N][ request=BYTES][ read=MODE
/// read_rate=BYTES_PER_SECOND]` line, or `None` where a field's value does
/// not parse; fields it does not know (a later version's) are skipped, and
/// a read mode without its rate is not used.
fn parse_line(line: &str) -> Option<(String, Remembered)> {
    let mut words = line.split_whitespace();
    let key = words.next()?;
    let (major, minor) = key.split_once(':')?;
    major.parse::<u32>().ok()?;
    minor.parse::<u32>().ok()?;
    let (mut depth, mut request, mut mode, mut rate) = (None, None, None, None);
    for word in words {
        let (name, value) = word.split_once('=')?;
        match name {
            "queue_depth" => {
                depth = Some(value.parse().ok().filter(|d| (MIN_DEPTH..=MAX_DEPTH).contains(d))?)
            }
            "request" => request = Some(parse_request(value)?),
            "read" => mode = Some(ReadMode::parse(value)?),
            "read_rate" => rate = Some(value.parse::<u64>().ok().filter(|&r| r > 0)?),
            _ => {}
        }
    }
    let read = mode.zip(rate).map(|(mode, rate)| RememberedRead { mode, rate });
    Some((key.to_owned(), Remembered { depth, request, read }))
}

/// A remembered request size: a power of two a plan's chunk may be.
fn parse_request(value: &str) -> Option<usize> {
    value.parse().ok().filter(|s: &usize| s.is_power_of_two() && (MIN_REQUEST..=MAX_REQUEST).contains(s))
}

/// What one line of the memory file remembers: a block device's reads,
/// or an object store endpoint's GETs.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Line {
    Device(Remembered),
    Endpoint(RememberedGets),
}

impl Line {
    fn parse(line: &str) -> Option<(String, Line)> {
        match line.strip_prefix(ENDPOINT_PREFIX) {
            Some(rest) => parse_endpoint_line(rest).map(|(key, gets)| (key, Line::Endpoint(gets))),
            None => parse_line(line).map(|(key, tuned)| (key, Line::Device(tuned))),
        }
    }

    fn write(&self, key: &str) -> String {
        match self {
            Line::Device(tuned) => {
                let mut line = key.to_owned();
                if let Some(depth) = tuned.depth {
                    line += &format!(" queue_depth={depth}");
                }
                if let Some(request) = tuned.request {
                    line += &format!(" request={request}");
                }
                if let Some(read) = tuned.read {
                    line += &format!(" read={} read_rate={}", read.mode.name(), read.rate);
                }
                line + "\n"
            }
            Line::Endpoint(gets) => {
                format!("{key} connections={} request={}\n", gets.connections, gets.request)
            }
        }
    }
}

/// Each line of the memory file that parses (others are skipped: the file
/// is a cache, never an error).
fn entries(path: &Path) -> Vec<(String, Line)> {
    let Ok(Some(bytes)) = crate::user_cache::read(path, MEMORY_LIMIT) else {
        return Vec::new();
    };
    String::from_utf8_lossy(&bytes).lines().filter_map(Line::parse).collect()
}

/// What is remembered for `device` in the memory file at `path`.
pub(crate) fn remembered(path: &Path, device: Device) -> Option<Remembered> {
    let key = device.key();
    entries(path).into_iter().find_map(|(k, line)| match line {
        Line::Device(tuned) if k == key => Some(tuned),
        _ => None,
    })
}

/// Remembers `tuned` for `device` in the memory file at `path`, creating
/// its directory; the other devices' and endpoints' lines are kept (see
/// [`crate::user_cache::replace`] for concurrent writers).
pub(crate) fn remember(path: &Path, device: Device, tuned: Remembered) -> io::Result<()> {
    replace_line(path, device.key(), Line::Device(tuned))
}

/// Writes the memory file at `path` with `line` for `key` in place of the
/// one it had, the others kept.
fn replace_line(path: &Path, key: String, line: Line) -> io::Result<()> {
    let mut entries = entries(path);
    entries.retain(|(k, _)| *k != key);
    entries.push((key, line));
    let text: String = entries.iter().map(|(k, line)| line.write(k)).collect();
    crate::user_cache::replace(path, text.as_bytes())
}

/// An object store's endpoint (`HOST:PORT`, the host as the endpoint URL
/// names it): what GETs are tuned for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Endpoint(String);

impl Endpoint {
    /// `None` for a host that could not be read back from a line.
    pub fn new(host: &str, port: u16) -> Option<Endpoint> {
        let fits = !host.is_empty() && !host.contains(|c: char| c.is_whitespace() || c.is_control());
        fits.then(|| Endpoint(format!("{host}:{port}")))
    }

    fn key(&self) -> String {
        format!("{ENDPOINT_PREFIX}{}", self.0)
    }
}

/// What an endpoint's GETs were tuned to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RememberedGets {
    pub connections: usize,
    pub request: usize,
}

/// The rest of one `s3 HOST:PORT connections=N request=BYTES` line after
/// `s3 `: `None` where the endpoint or a field does not parse or a field is
/// missing; fields it does not know are skipped.
fn parse_endpoint_line(rest: &str) -> Option<(String, RememberedGets)> {
    let mut words = rest.split_whitespace();
    let endpoint = words.next()?;
    let (host, port) = endpoint.rsplit_once(':')?;
    let endpoint = Endpoint::new(host, port.parse().ok()?)?;
    let (mut connections, mut request) = (None, None);
    for word in words {
        let (name, value) = word.split_once('=')?;
        match name {
            "connections" => {
                let fits = |n: &usize| (MIN_CONNECTIONS..=MAX_CONNECTIONS).contains(n);
                connections = Some(value.parse().ok().filter(fits)?);
            }
            "request" => request = Some(parse_request(value)?),
            _ => {}
        }
    }
    Some((endpoint.key(), RememberedGets { connections: connections?, request: request? }))
}

/// What is remembered for `endpoint` in the memory file at `path`.
pub(crate) fn remembered_gets(path: &Path, endpoint: &Endpoint) -> Option<RememberedGets> {
    let key = endpoint.key();
    entries(path).into_iter().find_map(|(k, line)| match line {
        Line::Endpoint(gets) if k == key => Some(gets),
        _ => None,
    })
}

/// Remembers `gets` for `endpoint` in the memory file at `path`, the other
/// lines kept (as [`remember`]).
pub(crate) fn remember_gets(path: &Path, endpoint: &Endpoint, gets: RememberedGets) -> io::Result<()> {
    replace_line(path, endpoint.key(), Line::Endpoint(gets))
}

#[cfg(test)]
mod tests {
    use super::*;

    use ReadMode::{Buffered, Direct};

    #[test]
    fn a_remembered_read_mode_is_read_back_and_old_lines_still_load() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tuning");
        let old = "8:0 queue_depth=16\n259:3 queue_depth=32 request=4194304\n";
        std::fs::write(&path, old).unwrap();
        assert_eq!(
            remembered(&path, device()),
            Some(Remembered { depth: Some(32), request: Some(4 << 20), read: None })
        );
        let read = Some(RememberedRead { mode: Buffered, rate: 1_610_612_736 });
        remember(&path, device(), Remembered { depth: Some(64), request: None, read }).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, "8:0 queue_depth=16\n259:3 queue_depth=64 read=buffered read_rate=1610612736\n");
        assert_eq!(remembered(&path, device()).unwrap().read, read);
        // A later version's fields are skipped; a mode without its rate,
        // or a mode not known, is not used.
        let lines = "259:3 queue_depth=32 read=direct read_rate=5 later=x\n8:0 queue_depth=16 read=direct\n\
                     8:1 queue_depth=16 read=sideways read_rate=5\n";
        std::fs::write(&path, lines).unwrap();
        assert_eq!(remembered(&path, device()).unwrap().read, Some(RememberedRead { mode: Direct, rate: 5 }));
        assert_eq!(remembered(&path, Device { major: 8, minor: 0 }).unwrap().read, None);
        assert_eq!(remembered(&path, Device { major: 8, minor: 1 }), None);
        // A line may remember a read mode alone: no depth or request size
        // was measured.
        let read = Some(RememberedRead { mode: Direct, rate: 7 });
        remember(&path, device(), Remembered { depth: None, request: None, read }).unwrap();
        assert!(std::fs::read_to_string(&path).unwrap().contains("\n259:3 read=direct read_rate=7\n"));
        assert_eq!(remembered(&path, device()), Some(Remembered { depth: None, request: None, read }));
    }

    fn device() -> Device {
        Device { major: 259, minor: 3 }
    }

    #[test]
    fn a_remembered_depth_is_read_back_and_other_devices_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing/dir/tuning");
        assert_eq!(remembered(&path, device()), None);
        let depth = |depth| Remembered { depth: Some(depth), request: None, read: None };
        remember(&path, Device { major: 8, minor: 0 }, depth(16)).unwrap();
        remember(&path, device(), depth(32)).unwrap();
        let tuned = Remembered { depth: Some(64), request: Some(4 << 20), read: None };
        remember(&path, device(), tuned).unwrap();
        assert_eq!(remembered(&path, device()), Some(tuned));
        assert_eq!(remembered(&path, Device { major: 8, minor: 0 }), Some(depth(16)));
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, "8:0 queue_depth=16\n259:3 queue_depth=64 request=4194304\n");
        let left: Vec<_> =
            std::fs::read_dir(path.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, ["tuning"], "no temporary file is left");
    }

    #[test]
    fn a_corrupt_memory_file_is_ignored_and_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tuning");
        let junk =
            "259:3 queue_depth=banana\n259:3 queue_depth=999999\nx:y queue_depth=8\n\u{0}\u{1}garbage\n\
                    259:3 queue_depth=32 request=3000000\n259:3 queue_depth=32 request=4096\n";
        std::fs::write(&path, junk).unwrap();
        assert_eq!(remembered(&path, device()), None);
        std::fs::write(&path, vec![b'a'; MEMORY_LIMIT as usize + 1]).unwrap();
        assert_eq!(remembered(&path, device()), None);
        std::fs::write(&path, [0xff, 0xfe, 0x00]).unwrap(); // not UTF-8
        assert_eq!(remembered(&path, device()), None);
        remember(&path, device(), Remembered { depth: Some(16), request: None, read: None }).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "259:3 queue_depth=16\n");
    }

    #[test]
    fn a_cache_directory_that_cannot_be_made_refuses_the_write_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        // A file where the directory should be: refused for any user (root
        // too, unlike a read-only directory; the CLI's test covers that).
        std::fs::write(dir.path().join("dmaload"), b"").unwrap();
        let path = dir.path().join("dmaload/tuning");
        assert!(remember(&path, device(), Remembered { depth: Some(64), request: None, read: None }).is_err());
        assert_eq!(remembered(&path, device()), None);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "no temporary file is left");
    }

    #[test]
    fn an_endpoints_line_is_read_back_beside_the_devices_and_a_garbled_one_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tuning");
        let endpoint = Endpoint::new("127.0.0.1", 3900).unwrap();
        let gets = RememberedGets { connections: 16, request: 4 << 20 };
        std::fs::write(&path, "259:3 queue_depth=32\n").unwrap();
        remember_gets(&path, &endpoint, gets).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, "259:3 queue_depth=32\ns3 127.0.0.1:3900 connections=16 request=4194304\n");
        assert_eq!(remembered_gets(&path, &endpoint), Some(gets));
        // A device's write keeps the endpoint's line, and the other way round.
        remember(&path, device(), Remembered { depth: Some(64), request: None, read: None }).unwrap();
        assert_eq!(remembered_gets(&path, &endpoint), Some(gets));
        assert_eq!(remembered(&path, device()).and_then(|tuned| tuned.depth), Some(64));
        assert_eq!(remembered_gets(&path, &Endpoint::new("127.0.0.1", 3901).unwrap()), None);
        let v6 = Endpoint::new("[::1]", 443).unwrap();
        remember_gets(&path, &v6, gets).unwrap();
        assert_eq!(remembered_gets(&path, &v6), Some(gets));
        for garbled in [
            "s3 127.0.0.1:3900 connections=banana request=4194304",
            "s3 127.0.0.1:3900 connections=9999 request=4194304",
            "s3 127.0.0.1:3900 connections=16 request=3000000",
            "s3 127.0.0.1:3900 connections=16",
            "s3 127.0.0.1:99999 connections=16 request=4194304",
            "s3 127.0.0.1 connections=16 request=4194304",
            "s3 :3900 connections=16 request=4194304",
            "s3 127.0.0.1:3900 connections=16 request",
        ] {
            std::fs::write(&path, format!("{garbled}\n")).unwrap();
            assert_eq!(remembered_gets(&path, &endpoint), None, "{garbled}");
        }
        // A later version's field is skipped; a line is never a device's.
        std::fs::write(&path, "s3 127.0.0.1:3900 connections=4 request=1048576 later=x\n").unwrap();
        assert_eq!(
            remembered_gets(&path, &endpoint),
            Some(RememberedGets { connections: 4, request: 1 << 20 })
        );
        assert_eq!(Endpoint::new("a b", 1), None);
        assert_eq!(Endpoint::new("", 1), None);
    }
}
