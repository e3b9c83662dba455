//! Device memory, pinned host memory, and the copies between them.

use std::ffi::{c_int, c_uint};
use std::fmt;
use std::marker::PhantomData;
use std::ops::Range;
use std::os::fd::BorrowedFd;
use std::sync::{Arc, Mutex};

use super::*;

/// A span of device memory that copies may write: `len` bytes from device
/// address `ptr`. Borrowed from a [`DeviceBuffer`] or made from raw parts
/// by a caller who vouches for them ([`DeviceRange::from_raw`]).
#[derive(Debug)]
pub struct DeviceRange<'a> {
    ptr: CUdeviceptr,
    len: usize,
    _memory: PhantomData<&'a mut [u8]>,
}

impl<'a> DeviceRange<'a> {
    /// A range from a device address and length (a tensor's `data_ptr()`
    /// and byte size, say).
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len` must be device memory of the device whose context
    /// the copies run in, allocated, and not freed for as long as copies
    /// into it may run (until a stream or event wait after the last one):
    /// that is longer than `'a` unless the copies are waited for within
    /// it. Nothing else may read or write the span meanwhile.
    pub unsafe fn from_raw(ptr: u64, len: usize) -> DeviceRange<'a> {
        DeviceRange { ptr, len, _memory: PhantomData }
    }

    /// [`DeviceRange::from_raw`] after [`DeviceRange::validate`]: refuses
    /// spans that are not device memory of `ctx`'s device or run past the
    /// end of their allocation. Still unsafe: no check can tell how long the
    /// memory stays allocated, or who else uses it.
    ///
    /// # Safety
    ///
    /// As for [`DeviceRange::from_raw`].
    pub unsafe fn checked(ctx: &Context, ptr: u64, len: usize) -> Result<DeviceRange<'a>, CudaError> {
        DeviceRange::validate(ctx, ptr, len)?;
        Ok(DeviceRange { ptr, len, _memory: PhantomData })
    }

    /// Checks, with `cuPointerGetAttribute`, that `ptr..ptr + len` is device
    /// (or managed) memory of `ctx`'s device inside one allocation
    /// (`CU_POINTER_ATTRIBUTE_RANGE_START_ADDR`/`RANGE_SIZE`). An allocation
    /// is what the driver handed out: a caching allocator's (PyTorch's)
    /// whole segment, not one tensor.
    pub fn validate(ctx: &Context, ptr: u64, len: usize) -> Result<(), CudaError> {
        const OP: &str = "check device range";
        if len == 0 {
            return Ok(());
        }
        let end = ptr.checked_add(len as u64).ok_or_else(|| {
            CudaError::invalid(OP, format!("{len} bytes at {ptr:#x} wrap the address space"))
        })?;
        let _current = ctx.enter()?;
        // SAFETY: MEMORY_TYPE writes an `unsigned int` (a CUmemorytype).
        let memory_type =
            match unsafe { ctx.pointer_attribute::<c_uint>(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr) } {
                Err(err) if err.code == Some(CUDA_ERROR_INVALID_VALUE) => {
                    return Err(CudaError {
                        op: OP,
                        message: format!(
                            "{ptr:#x} is not memory CUDA allocated or registered in this process ({})",
                            err.message
                        ),
                        errno: libc::EINVAL,
                        ..err
                    });
                }
                other => other?,
            };
        let kind = match memory_type {
            CU_MEMORYTYPE_DEVICE | CU_MEMORYTYPE_UNIFIED => None,
            CU_MEMORYTYPE_HOST => Some("host memory registered with CUDA"),
            CU_MEMORYTYPE_ARRAY => Some("a CUDA array"),
            0 => Some("not memory CUDA allocated or registered in this process"),
            _ => Some("memory of an unknown CUDA type"),
        };
        if let Some(kind) = kind {
            return Err(CudaError::invalid(OP, format!("{ptr:#x} is {kind}: not device memory")));
        }
        // SAFETY: DEVICE_ORDINAL writes an `int`.
        let ordinal = unsafe { ctx.pointer_attribute::<c_int>(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr) }?;
        if usize::try_from(ordinal).ok() != Some(ctx.ordinal()) {
            return Err(CudaError::invalid(
                OP,
                format!("{ptr:#x} is memory of cuda:{ordinal}, not of cuda:{}", ctx.ordinal()),
            ));
        }
        // SAFETY: RANGE_START_ADDR writes a `CUdeviceptr`.
        let start =
            unsafe { ctx.pointer_attribute::<CUdeviceptr>(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ptr) }?;
        // SAFETY: RANGE_SIZE writes a `size_t`.
        let size = unsafe { ctx.pointer_attribute::<usize>(CU_POINTER_ATTRIBUTE_RANGE_SIZE, ptr) }?;
        let alloc_end = start.saturating_add(size as u64);
        if start > ptr || end > alloc_end {
            return Err(CudaError::invalid(
                OP,
                format!(
                    "{len} bytes at {ptr:#x} run {} bytes past the end of their allocation \
                     ({size} bytes at {start:#x})",
                    end.saturating_sub(alloc_end)
                ),
            ));
        }
        Ok(())
    }

    /// The device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The part `offset..offset + len` of this range, or `None` where it
    /// does not lie inside it.
    pub fn sub(self, offset: usize, len: usize) -> Option<DeviceRange<'a>> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then(|| DeviceRange { ptr: self.ptr + offset as u64, len, _memory: PhantomData })
    }

    /// The allocation this range lies in, named for another process: the
    /// `cuIpcGetMemHandle` of its base (`CU_POINTER_ATTRIBUTE_RANGE_START_ADDR`,
    /// what `cuMemGetAddressRange` gives: the driver names whole allocations
    /// only, and a caching allocator's tensor, PyTorch's, lies inside a
    /// larger segment) and the range's offset from that base. `ctx` must be
    /// the context of the range's device.
    pub fn ipc_handle(&self, ctx: &Context) -> Result<(IpcHandle, u64), CudaError> {
        let _current = ctx.enter()?;
        // SAFETY: RANGE_START_ADDR writes a `CUdeviceptr`.
        let base =
            unsafe { ctx.pointer_attribute::<CUdeviceptr>(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, self.ptr) }?;
        let offset = self.ptr.checked_sub(base).ok_or_else(|| {
            CudaError::invalid(
                "cuMemGetAddressRange",
                format!("{:#x} lies before its base {base:#x}", self.ptr),
            )
        })?;
        Ok((ipc_handle_of(ctx, base)?, offset))
    }
}

/// `cuIpcGetMemHandle` of the allocation at `base`, with `ctx` current.
fn ipc_handle_of(ctx: &Context, base: CUdeviceptr) -> Result<IpcHandle, CudaError> {
    let api = ctx.inner.api;
    let _current = ctx.enter()?;
    let mut handle = CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: `handle` is a valid out-pointer; the driver checks that
    // `base` starts an allocation of this process.
    api.check("cuIpcGetMemHandle", unsafe { (api.ipc_get_mem_handle)(&mut handle, base) })?;
    Ok(IpcHandle(handle.reserved))
}

/// Device memory this value owns: `cuMemAlloc`, and on drop a wait for the
/// context (so no copy into it is still running) and `cuMemFree`.
pub struct DeviceBuffer {
    ctx: Context,
    ptr: CUdeviceptr,
    len: usize,
}

// SAFETY: a device address is usable from any thread with the context
// (kept alive by `ctx`) current, which every method makes it.
unsafe impl Send for DeviceBuffer {}
// SAFETY: `&self` methods only read the memory (copy_to_host).
unsafe impl Sync for DeviceBuffer {}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceBuffer(cuda:{}, {} bytes at {:#x})", self.ctx.ordinal(), self.len, self.ptr)
    }
}

impl DeviceBuffer {
    /// `len` bytes of uninitialised device memory (no allocation for 0).
    pub fn new(ctx: &Context, len: usize) -> Result<DeviceBuffer, CudaError> {
        let mut ptr: CUdeviceptr = 0;
        if len > 0 {
            let api = ctx.inner.api;
            let _current = ctx.enter()?;
            // SAFETY: `ptr` is a valid out-pointer for the call.
            api.check("cuMemAlloc", unsafe { (api.mem_alloc)(&mut ptr, len) })?;
        }
        Ok(DeviceBuffer { ctx: ctx.clone(), ptr, len })
    }

    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// The device address of the first byte (0 when empty).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The whole buffer as a copy destination. Copies into it may outlive
    /// the borrow: dropping the buffer waits for them.
    pub fn range(&mut self) -> DeviceRange<'_> {
        DeviceRange { ptr: self.ptr, len: self.len, _memory: PhantomData }
    }

    fn check_span(&self, op: &'static str, offset: usize, len: usize) -> Result<(), CudaError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(CudaError::invalid(
                op,
                format!("{len} bytes at offset {offset} run past the {}-byte device buffer", self.len),
            )),
        }
    }

    /// `cuMemcpyDtoH`: copies `dst.len()` bytes from `offset` into `dst`,
    /// returning once they are there. It does not wait for copies queued on
    /// a [`Stream`] (non-blocking streams): synchronize those first.
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<(), CudaError> {
        self.check_span("cuMemcpyDtoH", offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        let api = self.ctx.inner.api;
        let _current = self.ctx.enter()?;
        // SAFETY: the source span is inside this live allocation (checked);
        // `dst` is exclusively borrowed host memory of the same length, and
        // a copy into pageable memory is complete when the call returns.
        let code = unsafe { (api.memcpy_dtoh)(dst.as_mut_ptr().cast(), self.ptr + offset as u64, dst.len()) };
        api.check("cuMemcpyDtoH", code)
    }

    /// `cuMemsetD8`: sets every byte to `byte`, after the context's queued
    /// work and before returning (`cuCtxSynchronize` either side).
    pub fn fill(&mut self, byte: u8) -> Result<(), CudaError> {
        if self.len == 0 {
            return Ok(());
        }
        let api = self.ctx.inner.api;
        let _current = self.ctx.enter()?;
        self.ctx.synchronize_current()?;
        // SAFETY: the span is exactly this live allocation.
        api.check("cuMemsetD8", unsafe { (api.memset_d8)(self.ptr, byte, self.len) })?;
        self.ctx.synchronize_current()
    }

    /// [`DeviceBuffer::fill`] with zeros.
    pub fn zero(&mut self) -> Result<(), CudaError> {
        self.fill(0)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.len == 0 || self.ctx.is_wedged() {
            // A late copy could still write it: left to the driver.
            return;
        }
        let api = self.ctx.inner.api;
        let _current = self.ctx.enter_and_drain();
        // SAFETY: frees the allocation this value owns, after the wait for
        // every copy that could still write it; nothing uses it after.
        unsafe { (api.mem_free)(self.ptr) };
    }
}

impl DeviceBuffer {
    /// `cuIpcGetMemHandle`: a handle another process of this machine (the
    /// driver decides which: the same user, with the device visible) can
    /// open with [`IpcMemory::open`] to reach this memory, for as long as
    /// this buffer lives.
    pub fn ipc_handle(&self) -> Result<IpcHandle, CudaError> {
        if self.len == 0 {
            return Err(CudaError::invalid(
                "cuIpcGetMemHandle",
                "an empty buffer has no device memory".into(),
            ));
        }
        ipc_handle_of(&self.ctx, self.ptr)
    }
}

/// A `CUipcMemHandle`: 64 bytes that name a device allocation of another
/// process, to send over a socket as they are.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IpcHandle(pub [u8; 64]);

impl fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("IpcHandle(")?;
        for byte in &self.0 {
            write!(f, "{byte:02x}")?;
        }
        f.write_str(")")
    }
}

/// Device memory of another process, opened from its [`IpcHandle`]
/// (`cuIpcOpenMemHandle` with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`) in
/// this context; dropping it waits for the context (so no copy into it is
/// still running) and closes it (`cuIpcCloseMemHandle`). The memory stays
/// the other process's: it frees it, and it may do so while this is open
/// only at its own cost (the driver keeps the pages until the close).
pub struct IpcMemory {
    ctx: Context,
    ptr: CUdeviceptr,
    len: usize,
}

// SAFETY: as for DeviceBuffer: a device address usable from any thread with
// the context (kept alive by `ctx`) current, which every method makes it.
unsafe impl Send for IpcMemory {}
// SAFETY: no `&self` method touches the memory.
unsafe impl Sync for IpcMemory {}

impl fmt::Debug for IpcMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IpcMemory(cuda:{}, {} bytes at {:#x})", self.ctx.ordinal(), self.len, self.ptr)
    }
}

/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, the one `cuIpcOpenMemHandle` flag.
const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;

impl IpcMemory {
    /// Opens `handle` in `ctx`; its length is the allocation's
    /// (`CU_POINTER_ATTRIBUTE_RANGE_SIZE`).
    pub fn open(ctx: &Context, handle: &IpcHandle) -> Result<IpcMemory, CudaError> {
        let api = ctx.inner.api;
        let _current = ctx.enter()?;
        let mut ptr: CUdeviceptr = 0;
        let raw = CUipcMemHandle { reserved: handle.0 };
        // SAFETY: `ptr` is a valid out-pointer; the handle is passed by
        // value, as the prototype has it; the driver validates its bytes.
        let code = unsafe { (api.ipc_open_mem_handle)(&mut ptr, raw, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) };
        api.check("cuIpcOpenMemHandle", code)?;
        // Closed on drop, also when its size cannot be read.
        let mut opened = IpcMemory { ctx: ctx.clone(), ptr, len: 0 };
        // SAFETY: `ptr` is the base of the mapping just opened; the
        // attribute writes a size_t.
        opened.len = unsafe { ctx.pointer_attribute::<usize>(CU_POINTER_ATTRIBUTE_RANGE_SIZE, ptr) }?;
        Ok(opened)
    }

    /// The device address of the first byte, in this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The whole allocation as a copy destination. Copies into it may
    /// outlive the borrow: dropping this value waits for them.
    pub fn range(&mut self) -> DeviceRange<'_> {
        DeviceRange { ptr: self.ptr, len: self.len, _memory: PhantomData }
    }
}

impl Drop for IpcMemory {
    fn drop(&mut self) {
        if self.ctx.is_wedged() {
            // A late copy could still write it: the mapping stays open.
            return;
        }
        let api = self.ctx.inner.api;
        let _current = self.ctx.enter_and_drain();
        // SAFETY: closes the mapping this value opened, after the wait for
        // every copy that could still write it; nothing uses it after.
        unsafe { (api.ipc_close_mem_handle)(self.ptr) };
    }
}

/// `cuMemHostRegister(CU_MEMHOSTREGISTER_PORTABLE)`: pins `len` bytes at
/// `ptr` for DMA by every context.
///
/// # Safety
///
/// `ptr..ptr + len` must be mapped, and stay mapped until unregistered.
unsafe fn register_host(ctx: &Context, ptr: *mut u8, len: usize) -> Result<(), CudaError> {
    let api = ctx.inner.api;
    let _current = ctx.enter()?;
    // SAFETY: the span is mapped (this function's contract); the driver
    // pins its pages until cuMemHostUnregister.
    let code = unsafe { (api.mem_host_register)(ptr.cast(), len, CU_MEMHOSTREGISTER_PORTABLE) };
    api.check("cuMemHostRegister", code)
}

/// Waits for `ctx`, then `cuMemHostUnregister` of memory [`register_host`]
/// pinned (errors ignored: this runs in drops). In a wedged context the
/// pin stays (a late copy may read the pages) and `false` says the caller
/// must leave the memory mapped too.
fn unregister_host(ctx: &Context, ptr: *mut u8) -> bool {
    if ctx.is_wedged() {
        return false;
    }
    let api = ctx.inner.api;
    let _current = ctx.enter_and_drain();
    // SAFETY: `ptr` starts a registration made by `register_host`, which
    // is still mapped; the wait above let every copy from it finish.
    unsafe { (api.mem_host_unregister)(ptr.cast()) };
    true
}

/// `cuMemcpyHtoDAsync`: queues a copy of `src_range` of `src` to
/// `dst_offset..` of `dst` on `stream`, and returns at once when the source
/// is pinned (a [`PinnedStaging`]); an unpinned
/// source is first copied by the driver into its own staging memory.
///
/// The copy reads the source until the stream passes it, so the caller
/// must not let `src_range` be rewritten before an [`Event`] recorded on
/// `stream` after the copy completes: a rule for the bytes' integrity, not
/// for memory safety, since a pinned range stays pinned (and its mapping
/// mapped) until a wait for the context. The same wait in
/// [`DeviceBuffer`]'s drop, or [`DeviceRange::from_raw`]'s contract, keeps
/// the destination allocated. A registration waits only for its own
/// context: copy from it on streams of that context.
///
/// `src_range` outside the mapping is a bug and panics; a destination span
/// outside `dst` is an error.
pub fn copy_htod_async(
    dst: &DeviceRange<'_>,
    dst_offset: usize,
    src: MappingWriter<'_>,
    src_range: Range<usize>,
    stream: &Stream,
) -> Result<(), CudaError> {
    let (ptr, len) = src.raw_range(&src_range);
    match dst_offset.checked_add(len) {
        Some(end) if end <= dst.len => {}
        _ => {
            return Err(CudaError::invalid(
                "cuMemcpyHtoDAsync",
                format!("{len} bytes at offset {dst_offset} run past the {}-byte device range", dst.len),
            ))
        }
    }
    if len == 0 {
        return Ok(());
    }
    let api = stream.ctx.inner.api;
    let _current = stream.ctx.enter()?;
    // SAFETY: the source is `len` bytes inside a live mapping (raw_range),
    // pinned until a context wait or staged by the driver before return;
    // the destination span is inside `dst` (checked), device memory that
    // stays allocated while copies into it may run (DeviceRange's
    // contract); the stream is live.
    let code = unsafe {
        (api.memcpy_htod_async)(dst.ptr + dst_offset as u64, ptr.cast_const().cast(), len, stream.raw)
    };
    api.check("cuMemcpyHtoDAsync", code)
}

/// Pinned host memory this value owns: an anonymous mapping, registered
/// with `cuMemHostRegister(CU_MEMHOSTREGISTER_PORTABLE)`, to stage bytes
/// for asynchronous copies to a device: all of it at once
/// ([`PinnedStaging::new`]), or unit by unit as copies first need it
/// ([`PinnedStaging::unpinned`], then [`StagingPins::pin`]). Dropping it
/// waits for its context before unpinning and unmapping.
pub struct PinnedStaging {
    // Unregistered in `drop`, before the field drops and unmaps.
    memory: Mapping,
    pins: Arc<Pins>,
}

/// The registrations of a [`PinnedStaging`]'s memory, shared with the
/// [`StagingPins`] handles that pin more of it.
struct Pins {
    ctx: Context,
    /// The mapping's first byte and length.
    base: *mut u8,
    len: usize,
    /// Bytes of a unit: registrations start and end on units (or the end).
    unit: usize,
    /// The registered runs of units, disjoint; `None` once the memory is
    /// being unpinned for good (its owner's drop), after which nothing is
    /// registered again.
    runs: Mutex<Option<Vec<Range<usize>>>>,
}

// SAFETY: `base` is an address in a mapping the owning PinnedStaging keeps
// mapped while `runs` is `Some`, and every registration through it is made
// and undone under the `runs` lock; the pin is driver-side state usable
// from any thread.
unsafe impl Send for Pins {}
// SAFETY: as above: every use of `base` holds the lock.
unsafe impl Sync for Pins {}

// SAFETY: the mapping is plain memory (Mapping is Send) and `pins` is Send.
unsafe impl Send for PinnedStaging {}
// SAFETY: `&self` methods only read lengths, or pin under `pins`' lock.
unsafe impl Sync for PinnedStaging {}

impl fmt::Debug for PinnedStaging {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pinned = StagingPins(Arc::clone(&self.pins)).pinned_len();
        write!(f, "PinnedStaging(cuda:{}, {} bytes, {pinned} pinned)", self.pins.ctx.ordinal(), self.len())
    }
}

impl PinnedStaging {
    /// `len` bytes of zeroed, pinned host memory.
    pub fn new(ctx: &Context, len: usize) -> Result<PinnedStaging, CudaError> {
        let staging = PinnedStaging::unpinned(ctx, len, len.max(1))?;
        staging.pins().pin(0..len)?;
        Ok(staging)
    }

    /// `len` bytes of zeroed host memory, none of it pinned (nor faulted
    /// in) yet: [`StagingPins::pin`] registers it in whole units of `unit`
    /// bytes (rounded up to pages) as copies first need them.
    pub fn unpinned(ctx: &Context, len: usize, unit: usize) -> Result<PinnedStaging, CudaError> {
        let mut memory = Mapping::anonymous(len, HugePageAdvice::Huge).map_err(|err| {
            CudaError::new(
                "mmap",
                format!("{len} bytes of staging memory: {err}"),
                err.raw_os_error().unwrap_or(libc::EIO),
            )
        })?;
        let (base, _) = memory.writer().raw_range(&(0..len));
        let unit = unit.max(1).next_multiple_of(crate::sys::mem::page_size());
        let runs = Mutex::new(Some(Vec::new()));
        let pins = Arc::new(Pins { ctx: ctx.clone(), base, len, unit, runs });
        Ok(PinnedStaging { memory, pins })
    }

    /// A handle that pins more of this memory, usable from any thread for
    /// as long as the memory lives (after that, its pins are errors).
    pub fn pins(&self) -> StagingPins {
        StagingPins(Arc::clone(&self.pins))
    }

    pub fn len(&self) -> usize {
        self.memory.as_slice().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn check_span(&self, op: &'static str, range: &Range<usize>) -> Result<(), CudaError> {
        if range.start <= range.end && range.end <= self.len() {
            Ok(())
        } else {
            Err(CudaError::invalid(
                op,
                format!("bytes {range:?} run past the {}-byte staging memory", self.len()),
            ))
        }
    }

    /// Write access for the kernel and io_uring (reads into staging
    /// slots). The borrow keeps the memory mapped meanwhile.
    pub(crate) fn writer(&mut self) -> MappingWriter<'_> {
        self.memory.writer()
    }

    /// Copies `data` in at `offset`. A copy still reading those bytes (see
    /// [`PinnedStaging::copy_to_device`]) would send a mix of old and new.
    pub fn write(&mut self, offset: usize, data: &[u8]) -> Result<(), CudaError> {
        let range = offset..offset.saturating_add(data.len());
        self.check_span("write staging memory", &range)?;
        self.memory.as_mut_slice()[range].copy_from_slice(data);
        Ok(())
    }

    /// `cuMemcpyHtoDAsync`: queues a copy of `range` to `dst_offset..` of
    /// `dst` on `stream` (which must be of this memory's context) and
    /// returns at once, pinning the range first where it is not yet. The
    /// copy reads the staging bytes until the stream passes it: record an
    /// [`Event`] after it and wait for the event before writing `range`
    /// again, or the device may get a mix of old and new bytes. Dropping
    /// the staging memory waits for the context, so no copy reads it after
    /// it is unpinned.
    pub fn copy_to_device(
        &mut self,
        range: Range<usize>,
        dst: &DeviceRange<'_>,
        dst_offset: usize,
        stream: &Stream,
    ) -> Result<(), CudaError> {
        const OP: &str = "cuMemcpyHtoDAsync";
        self.check_span(OP, &range)?;
        if !stream.ctx.same(&self.pins.ctx) {
            return Err(CudaError::invalid(
                OP,
                format!(
                    "a stream of cuda:{} copying from staging memory of cuda:{}: use a stream of the same context",
                    stream.ctx.ordinal(),
                    self.pins.ctx.ordinal()
                ),
            ));
        }
        self.pins().pin(range.clone())?;
        copy_htod_async(dst, dst_offset, self.memory.writer(), range, stream)
    }
}

impl Drop for PinnedStaging {
    fn drop(&mut self) {
        let pins = &self.pins;
        let runs = pins.runs.lock().unwrap_or_else(|p| p.into_inner()).take().unwrap_or_default();
        let mut unpinned = true;
        for run in runs {
            // SAFETY: `base + run.start` starts a registration of this mapping.
            unpinned &= unregister_host(&pins.ctx, unsafe { pins.base.add(run.start * pins.unit) });
        }
        if !unpinned {
            // Still pinned for a copy that may yet read it: the address
            // range stays mapped, never reused for another registration.
            if let Ok(empty) = Mapping::anonymous(0, HugePageAdvice::Small) {
                std::mem::forget(std::mem::replace(&mut self.memory, empty));
            }
        }
    }
}

/// Pins parts of a [`PinnedStaging`]'s memory as copies first need them
/// (cloned from [`PinnedStaging::pins`]; shareable between threads).
#[derive(Clone)]
pub struct StagingPins(Arc<Pins>);

impl fmt::Debug for StagingPins {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StagingPins({} of {} bytes pinned)", self.pinned_len(), self.0.len)
    }
}

impl StagingPins {
    /// Makes bytes `range` of the memory part of one registration (so one
    /// copy from anywhere in it runs from pinned memory): nothing where
    /// they are already, else `cuMemHostRegister` of the whole units they
    /// fall in, together with any registered run those units touch (which
    /// is unregistered first, after a wait for the context: its copies
    /// have landed). Pinning faults the pages in. An error once the memory
    /// is gone, or the driver's (what was unregistered for the merge then
    /// stays unpinned).
    pub fn pin(&self, range: Range<usize>) -> Result<(), CudaError> {
        const OP: &str = "cuMemHostRegister";
        let pins = &*self.0;
        if range.is_empty() {
            return Ok(());
        }
        if range.end > pins.len {
            return Err(CudaError::invalid(
                OP,
                format!("bytes {range:?} run past the {}-byte staging memory", pins.len),
            ));
        }
        let mut guard = pins.runs.lock().unwrap_or_else(|p| p.into_inner());
        let runs = guard
            .as_mut()
            .ok_or_else(|| CudaError::invalid(OP, "the staging memory was freed".to_string()))?;
        let units = range.start / pins.unit..range.end.div_ceil(pins.unit);
        if runs.iter().any(|run| run.start <= units.start && units.end <= run.end) {
            return Ok(());
        }
        let mut merged = units.clone();
        let mut kept = Vec::with_capacity(runs.len());
        for run in runs.drain(..) {
            if run.start < units.end && units.start < run.end {
                merged = merged.start.min(run.start)..merged.end.max(run.end);
                // SAFETY: `base + run.start` starts a registration of this
                // mapping, which is mapped while `runs` is `Some`.
                unregister_host(&pins.ctx, unsafe { pins.base.add(run.start * pins.unit) });
            } else {
                kept.push(run);
            }
        }
        *runs = kept;
        let start = merged.start * pins.unit;
        let len = (merged.end * pins.unit).min(pins.len) - start;
        // Whole pages, as older drivers require.
        let pages = len.next_multiple_of(crate::sys::mem::page_size());
        // SAFETY: `start` is inside the mapping (a unit boundary before its
        // length), so the pointer stays in its allocation.
        let first = unsafe { pins.base.add(start) };
        // SAFETY: the span lies in the mapping (units end at its length,
        // mmap maps whole pages), which stays mapped until the owner's drop
        // takes `runs` under this lock and unregisters every run first.
        unsafe { register_host(&pins.ctx, first, pages) }?;
        runs.push(merged);
        Ok(())
    }

    /// Bytes of the memory registered now.
    pub fn pinned_len(&self) -> usize {
        let pins = &*self.0;
        let runs = pins.runs.lock().unwrap_or_else(|p| p.into_inner());
        let units: usize = runs.iter().flatten().map(|run| run.len()).sum();
        (units * pins.unit).min(pins.len)
    }
}

/// `CU_MEMHOSTREGISTER_READ_ONLY` (CUDA 11.1): the driver pins the pages
/// for reading only, so memory that may not be written (a sealed memfd)
/// can be registered.
const CU_MEMHOSTREGISTER_READ_ONLY: c_uint = 0x08;

/// A read-only mapping of a file (a cached file's sealed memfd) pinned for
/// every context (`cuMemHostRegister(PORTABLE | READ_ONLY)`), so copies
/// from it to any device run at the link's speed without staging: pinned
/// once, copied from by every load. Dropping it waits for its context
/// before unpinning and unmapping.
pub struct RegisteredFile {
    ctx: Context,
    // Unregistered in `drop`, before the field drops and unmaps.
    memory: Mapping,
    ptr: *mut u8,
}

// SAFETY: as for PinnedStaging: plain memory and a driver-side pin.
unsafe impl Send for RegisteredFile {}
// SAFETY: `&self` methods only read (the copies read the pages).
unsafe impl Sync for RegisteredFile {}

impl fmt::Debug for RegisteredFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RegisteredFile({} bytes)", self.len())
    }
}

impl RegisteredFile {
    /// Maps the first `len` bytes of `fd` (copy-on-write, never written)
    /// and pins them read-only, through `ctx`.
    pub fn map(ctx: &Context, fd: BorrowedFd<'_>, len: usize) -> Result<RegisteredFile, CudaError> {
        let mut memory = Mapping::private(fd, len).map_err(|err| {
            CudaError::new(
                "mmap",
                format!("{len} bytes of a file: {err}"),
                err.raw_os_error().unwrap_or(libc::EIO),
            )
        })?;
        let (ptr, _) = memory.writer().raw_range(&(0..len));
        if len > 0 {
            let pages = len.next_multiple_of(crate::sys::mem::page_size());
            let api = ctx.inner.api;
            let _current = ctx.enter()?;
            // SAFETY: the span is the whole mapping, which `memory` keeps
            // mapped at this address until after `drop` unregisters it.
            let code = unsafe {
                (api.mem_host_register)(
                    ptr.cast(),
                    pages,
                    CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_READ_ONLY,
                )
            };
            api.check("cuMemHostRegister", code)?;
        }
        Ok(RegisteredFile { ctx: ctx.clone(), memory, ptr })
    }

    pub fn len(&self) -> usize {
        self.memory.as_slice().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `cuMemcpyHtoDAsync` of `range` of the file to `dst_offset..` of
    /// `dst`, on a stream of this registration's context (its drop waits
    /// only for that one). Spans outside either side are errors.
    pub fn copy_to_device(
        &self,
        range: Range<usize>,
        dst: &DeviceRange<'_>,
        dst_offset: usize,
        stream: &Stream,
    ) -> Result<(), CudaError> {
        const OP: &str = "cuMemcpyHtoDAsync";
        if range.start > range.end || range.end > self.len() {
            return Err(CudaError::invalid(
                OP,
                format!("bytes {range:?} run past the {}-byte file", self.len()),
            ));
        }
        let len = range.len();
        match dst_offset.checked_add(len) {
            Some(end) if end <= dst.len => {}
            _ => {
                return Err(CudaError::invalid(
                    OP,
                    format!("{len} bytes at offset {dst_offset} run past the {}-byte device range", dst.len),
                ))
            }
        }
        if !stream.ctx.same(&self.ctx) {
            return Err(CudaError::invalid(OP, "the stream is not of the registration's context".into()));
        }
        if len == 0 {
            return Ok(());
        }
        let api = stream.ctx.inner.api;
        let _current = stream.ctx.enter()?;
        // SAFETY: `range` is inside the mapping (checked above).
        let src = unsafe { self.ptr.add(range.start) };
        // SAFETY: the source is inside this live, pinned mapping (checked),
        // which stays mapped and pinned until a wait for the context in
        // `drop`; the destination span is inside `dst` (checked), device
        // memory that stays allocated while copies into it may run
        // (DeviceRange's contract); the stream is live.
        let code = unsafe {
            (api.memcpy_htod_async)(dst.ptr + dst_offset as u64, src.cast_const().cast(), len, stream.raw)
        };
        api.check(OP, code)
    }
}

impl Drop for RegisteredFile {
    fn drop(&mut self) {
        if !self.is_empty() && !unregister_host(&self.ctx, self.ptr) {
            // A late copy may still read the pages: they stay mapped.
            if let Ok(empty) = Mapping::anonymous(0, HugePageAdvice::Small) {
                std::mem::forget(std::mem::replace(&mut self.memory, empty));
            }
        }
    }
}
