//! Serving a GPU load: the client allocates its device memory and sends a
//! CUDA IPC handle of it; the service pins the cached file's memfd once
//! (`cuMemHostRegister`, read-only), opens the handle, copies on a stream
//! of its own into the span the client offered (an offset and a length
//! inside the allocation the handle names), waits, and closes the handle
//! before it answers. The client pins nothing and copies nothing.
//!
//! Security: the service writes into device memory only for a client of
//! its own uid or root (`SO_PEERCRED`), even where `allow_uids` lets other
//! users get files: a handle names memory of whichever process made it,
//! and the driver lets the service open any of its own user's, so another
//! user's client could otherwise have the service overwrite the device
//! memory of the service user's processes.

use std::sync::Arc;

use dmaload::cuda::{Context, CudaError, Event, IpcHandle, IpcMemory, RegisteredFile, Stream};
use dmaload::error::{Error, ErrorKind, Result};
use dmaload::share::protocol::{DeviceTarget, DEVICE_UNREACHABLE_OPS};

use super::*;

/// The operation named when the client's memory cannot be opened (the
/// client then loads directly), and when the copy fails (an error).
const OPEN_OP: &str = DEVICE_UNREACHABLE_OPS[0];
const REGISTER_OP: &str = DEVICE_UNREACHABLE_OPS[1];
const COPY_OP: &str = "copy to the client's device memory";
/// Bytes copied between two progress counts (see `copy_to_device`).
const PROGRESS_PIECE: usize = 16 << 20;

impl State {
    /// Copies the cached file `loaded` into the device memory `target`
    /// names, for a client of uid `peer_uid`; returns once the bytes are
    /// there and the memory is closed again.
    pub(super) fn copy_to_device(&self, loaded: &Loaded, target: &DeviceTarget, peer_uid: u32) -> Result<()> {
        let path = &loaded.path;
        let unreachable =
            |op: &'static str, message: String| Error::new(ErrorKind::InvalidInput, op, path, message);
        if peer_uid != self.own_uid && peer_uid != 0 {
            return Err(unreachable(
                OPEN_OP,
                format!(
                    "uid {peer_uid} is not the service's user (uid {}): it writes into the device memory of \
                     its own user's processes only",
                    self.own_uid
                ),
            ));
        }
        if target.len < loaded.len {
            return Err(Error::new(
                ErrorKind::Changed,
                COPY_OP,
                path,
                format!(
                    "the client allocated {} bytes for a {}-byte file: it changed",
                    target.len, loaded.len
                ),
            ));
        }
        let handle = target.handle_bytes().map_err(|e| Error::io(OPEN_OP, path, e))?;
        let cuda = |op: &'static str| move |e: CudaError| unreachable(op, e.to_string());
        let ordinal = target.ordinal as usize;
        let context = self.device_context(ordinal).map_err(cuda(OPEN_OP))?;
        let registered = loaded.registered(&context).map_err(cuda(REGISTER_OP))?;
        let mut memory = IpcMemory::open(&context, &IpcHandle(handle)).map_err(cuda(OPEN_OP))?;
        // The handle names the whole allocation; the client's span of it
        // must lie inside, or the copy would write memory it did not offer.
        if !target.offset.checked_add(target.len).is_some_and(|end| end <= memory.len() as u64) {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                COPY_OP,
                path,
                format!(
                    "the client offered {} bytes at offset {} of a {}-byte allocation: they run past its end",
                    target.len,
                    target.offset,
                    memory.len()
                ),
            ));
        }
        let failed = |e: CudaError| Error::io(COPY_OP, path, e.into());
        let too_large = || unreachable(COPY_OP, "too large".into());
        let start = usize::try_from(loaded.offset).map_err(|_| too_large())?;
        let len = usize::try_from(loaded.len).map_err(|_| too_large())?;
        let at_offset = usize::try_from(target.offset).map_err(|_| too_large())?;
        let stream = Stream::new(&context).map_err(failed)?;
        let dst = memory.range();
        // All queued at once, each piece followed by an event; as each
        // completes its bytes count in what the keepalives report, so a
        // client sees a long copy over a slow link move, not stall.
        let mut pieces = Vec::new();
        for at in (0..len).step_by(PROGRESS_PIECE) {
            let end = len.min(at + PROGRESS_PIECE);
            registered
                .copy_to_device(start + at..start + end, &dst, at_offset + at, &stream)
                .map_err(failed)?;
            let done = Event::new(&context).map_err(failed)?;
            done.record(&stream).map_err(failed)?;
            pieces.push((done, end - at));
        }
        // Every piece waited for before the close (the drop) and the reply.
        for (done, bytes) in pieces {
            done.synchronize().map_err(failed)?;
            self.loaded.fetch_add(bytes as u64, Ordering::Relaxed);
        }
        drop(memory);
        Ok(())
    }

    /// The primary context of device `ordinal`, retained once for the
    /// service's life.
    fn device_context(&self, ordinal: usize) -> std::result::Result<Context, CudaError> {
        let mut contexts = lock(&self.device_contexts);
        if let Some((_, context)) = contexts.iter().find(|(at, _)| *at == ordinal) {
            return Ok(context.clone());
        }
        let context = Context::primary(ordinal)?;
        contexts.push((ordinal, context.clone()));
        Ok(context)
    }
}

impl Loaded {
    /// The file's memfd mapped and pinned for every device, once: the
    /// first GPU client pays for it, the others copy from it, and it is
    /// unpinned when the file leaves the cache.
    fn registered(&self, context: &Context) -> std::result::Result<Arc<RegisteredFile>, CudaError> {
        let mut registered = lock(&self.registered);
        if let Some(file) = registered.as_ref() {
            return Ok(Arc::clone(file));
        }
        let len = usize::try_from(self.offset + self.len).unwrap_or(usize::MAX);
        let file = Arc::new(RegisteredFile::map(context, self.memfd.as_fd(), len)?);
        *registered = Some(Arc::clone(&file));
        Ok(file)
    }
}
