//! One error type for the whole crate: what was being done, to which file,
//! at which offset, and why.

use std::borrow::Cow;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// What went wrong, beyond the OS error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A system call failed; the OS error says why.
    Io,
    /// The file ended before the expected number of bytes were read (it was
    /// shorter than the range asked for, or was truncated during the load).
    Truncated,
    /// The file does not fit in the memory that is available.
    OutOfMemory,
    /// Direct I/O was required (`--direct`) but cannot be used.
    DirectIoUnavailable,
    /// The options or arguments are invalid.
    InvalidInput,
    /// The file was written during the load: its size, modification or
    /// change time moved between the first look and the last.
    Changed,
    /// The caller cancelled the operation (a [`crate::CancelToken`]); nothing
    /// it produced was handed out.
    Cancelled,
    /// The bytes do not match the digest their `B3SUMS` or `SHA256SUMS`
    /// file records (a load with `verify`); nothing was handed out.
    Corrupt,
}

/// A failed operation on a file.
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    /// Named by this crate (static), or received from a cache service.
    op: Cow<'static, str>,
    path: PathBuf,
    offset: Option<u64>,
    source: io::Error,
    /// The OS error number of an error whose `source` is a message (an
    /// `io::Error` holds either a number or a message, never both).
    errno: Option<i32>,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A failed system call `op` on `path`.
    pub fn io(op: &'static str, path: &Path, source: io::Error) -> Self {
        Error {
            kind: ErrorKind::Io,
            op: Cow::Borrowed(op),
            path: path.to_owned(),
            offset: None,
            source,
            errno: None,
        }
    }

    /// A failed system call `op` on `path` that failed with `errno`, told
    /// with `message` (what the number means here): both reach the caller,
    /// [`Error::raw_os_error`] and [`Error::errno`] give `errno`.
    pub fn with_errno(op: &'static str, path: &Path, errno: i32, message: impl Into<String>) -> Self {
        let source = io::Error::new(io::Error::from_raw_os_error(errno).kind(), message.into());
        Error { errno: Some(errno), ..Error::io(op, path, source) }
    }

    /// An error of `kind` with a message instead of an OS error.
    pub fn new(kind: ErrorKind, op: &'static str, path: &Path, message: impl Into<String>) -> Self {
        let errno = io::Error::from_raw_os_error(default_errno(kind));
        let source = io::Error::new(errno.kind(), message.into());
        Error { kind, op: Cow::Borrowed(op), path: path.to_owned(), offset: None, source, errno: None }
    }

    /// The same error, located at byte `offset` of the file.
    pub fn at(mut self, offset: u64) -> Self {
        self.offset = Some(offset);
        self
    }

    /// The same error, of `kind` (an OS error that stands for one, as
    /// crossing a socket needs).
    pub(crate) fn with_kind(mut self, kind: ErrorKind) -> Self {
        self.kind = kind;
        self
    }

    /// The same error with `note` added to its message; an OS error keeps
    /// its number ([`Error::raw_os_error`]).
    pub(crate) fn with_note(mut self, note: &str) -> Self {
        self.errno = self.raw_os_error();
        self.source = io::Error::new(self.source.kind(), format!("{}{note}", self.source));
        self
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The operation that failed, e.g. "open", "read", "register buffer".
    pub fn op(&self) -> &str {
        &self.op
    }

    /// The same error, of operation `op` as another process named it (a
    /// cache service's failed load crosses the socket whole).
    pub(crate) fn with_op(mut self, op: String) -> Self {
        self.op = Cow::Owned(op);
        self
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The byte offset in the file where the failure happened, if it is
    /// tied to one.
    pub fn offset(&self) -> Option<u64> {
        self.offset
    }

    /// The OS error number, when a system call failed (also for errors
    /// that carry a message beside it: [`Error::with_errno`]).
    pub fn raw_os_error(&self) -> Option<i32> {
        self.source.raw_os_error().or(self.errno)
    }

    /// The errno that best describes this error, for bindings that need one
    /// (Python's OSError): the OS error when there is one, else one chosen
    /// per kind (ENODATA for a truncated file, ESTALE for one written during
    /// the load, EBADMSG for bytes that fail verification, ECANCELED, ENOMEM,
    /// EINVAL).
    pub fn errno(&self) -> i32 {
        self.raw_os_error().unwrap_or(default_errno(self.kind))
    }

    /// The underlying I/O error.
    pub fn io_error(&self) -> &io::Error {
        &self.source
    }
}

/// The errno that stands for an error of `kind` that has no OS error.
fn default_errno(kind: ErrorKind) -> i32 {
    match kind {
        ErrorKind::Io => libc::EIO,
        ErrorKind::Truncated => libc::ENODATA,
        ErrorKind::OutOfMemory => libc::ENOMEM,
        ErrorKind::DirectIoUnavailable | ErrorKind::InvalidInput => libc::EINVAL,
        ErrorKind::Cancelled => libc::ECANCELED,
        ErrorKind::Changed => libc::ESTALE,
        ErrorKind::Corrupt => libc::EBADMSG,
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.op, self.path.display())?;
        if let Some(offset) = self.offset {
            write!(f, " at offset {offset}")?;
        }
        write!(f, ": {}", self.source)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// The whole message, of the OS error's kind. (An `io::Error` holds a
/// number or a message, not both: read [`Error::errno`] before converting
/// where the number matters.)
impl From<Error> for io::Error {
    fn from(err: Error) -> io::Error {
        io::Error::new(err.source.kind(), err.to_string())
    }
}

/// Serializes a path as a string, replacing bytes that are not UTF-8 with
/// U+FFFD, so that a report about any file can be printed as JSON (serde
/// refuses a non-UTF-8 `Path`).
pub fn serialize_path<S: serde::Serializer>(path: &Path, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&path.to_string_lossy())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_keeps_both_its_message_and_its_errno() {
        let path = Path::new("/x");
        let told = Error::with_errno("seal memfd", path, libc::EBUSY, "someone still maps it writable");
        assert_eq!((told.raw_os_error(), told.errno()), (Some(libc::EBUSY), libc::EBUSY));
        assert!(told.to_string().ends_with("someone still maps it writable"), "{told}");
        // A note added to an OS error keeps the number too.
        let noted = Error::io("read", path, io::Error::from_raw_os_error(libc::EIO)).with_note("; more");
        assert_eq!(noted.raw_os_error(), Some(libc::EIO));
        assert!(noted.to_string().ends_with("; more"), "{noted}");
    }
}
