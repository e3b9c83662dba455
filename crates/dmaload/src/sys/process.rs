//! Process-wide facts: CPU time, resource limits, kernel release.

use std::io;
use std::mem::MaybeUninit;
use std::time::Duration;

use super::check;

/// User and system CPU time consumed by the whole process so far
/// (`getrusage(RUSAGE_SELF)`: all threads, io_uring workers included).
pub fn cpu_time() -> io::Result<(Duration, Duration)> {
    let mut usage = MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `usage` is a writable rusage the kernel fills.
    check(unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) })?;
    // SAFETY: filled by a successful getrusage.
    let usage = unsafe { usage.assume_init() };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, (t.tv_usec as u32) * 1000);
    Ok((tv(usage.ru_utime), tv(usage.ru_stime)))
}

/// The soft `RLIMIT_MEMLOCK` in bytes (`None` when unlimited).
pub fn memlock_limit() -> io::Result<Option<u64>> {
    soft_limit(libc::RLIMIT_MEMLOCK)
}

/// The soft `RLIMIT_FSIZE` in bytes (`None` when unlimited): the largest
/// file, memfds included, this process may make; going past it raises
/// SIGXFSZ, which kills a process that does not handle it.
pub fn file_size_limit() -> io::Result<Option<u64>> {
    soft_limit(libc::RLIMIT_FSIZE)
}

/// Why this process may not make a file (a memfd included) of `len`
/// bytes: past the soft `RLIMIT_FSIZE`, where the kernel would kill it with
/// SIGXFSZ. `None` where it may, or where the limit cannot be read (the
/// write itself then tells).
pub fn past_file_size_limit(len: u64) -> Option<String> {
    let limit = file_size_limit().ok().flatten().filter(|&limit| len > limit)?;
    Some(format!("{len} bytes are past RLIMIT_FSIZE ({limit} bytes): raise it (ulimit -f)"))
}

/// The soft `RLIMIT_NOFILE` (`None` when unlimited): one more than the
/// highest descriptor number this process may open.
pub fn open_files_limit() -> io::Result<Option<u64>> {
    soft_limit(libc::RLIMIT_NOFILE)
}

fn soft_limit(resource: libc::__rlimit_resource_t) -> io::Result<Option<u64>> {
    let mut lim = MaybeUninit::<libc::rlimit>::zeroed();
    // SAFETY: `lim` is a writable rlimit the kernel fills.
    check(unsafe { libc::getrlimit(resource, lim.as_mut_ptr()) })?;
    // SAFETY: filled by a successful getrlimit.
    let lim = unsafe { lim.assume_init() };
    Ok((lim.rlim_cur != libc::RLIM_INFINITY).then_some(lim.rlim_cur))
}

/// The running kernel's release string (`uname(2)`), e.g. "6.18.4".
pub fn kernel_release() -> io::Result<String> {
    let mut uts = MaybeUninit::<libc::utsname>::zeroed();
    // SAFETY: `uts` is a writable utsname the kernel fills.
    check(unsafe { libc::uname(uts.as_mut_ptr()) })?;
    // SAFETY: filled by a successful uname.
    let uts = unsafe { uts.assume_init() };
    let bytes: Vec<u8> = uts.release.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// The running kernel's (major, minor) version, from its release string;
/// `None` where that does not start with two numbers.
pub fn kernel_version() -> Option<(u32, u32)> {
    let release = kernel_release().ok()?;
    let mut numbers = release.split(|c: char| !c.is_ascii_digit());
    Some((numbers.next()?.parse().ok()?, numbers.next()?.parse().ok()?))
}

/// Whether process `pid` exists in this PID namespace (`kill(pid, 0)`):
/// ESRCH means it does not; EPERM means it does (another user's). Only
/// positive PIDs are asked, as 0 and negative numbers name process groups.
pub fn process_exists(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return false };
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 sends nothing; kill only checks that `pid` exists.
    let ret = unsafe { libc::kill(pid, 0) };
    ret == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// The effective user ID (`geteuid(2)`), which the kernel's file
/// protections compare with owners.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid takes no arguments and cannot fail.
    unsafe { libc::geteuid() }
}
