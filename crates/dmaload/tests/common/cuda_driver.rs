//! Which CUDA driver a test process uses: shared by the library's tests
//! (`common::cuda_driver`) and the CLI's (included by path).

use std::path::Path;

/// Chooses, once per test process and before its first CUDA call, the CUDA
/// driver its tests use: `$DMALOAD_LIBCUDA` when set; else the installed
/// NVIDIA driver when `libcuda.so.1` loads (a GPU machine, bench/gpu-kit.sh),
/// unless `DMALOAD_TEST_CUDA=emulator`; else the emulator in tests/cuda-emu,
/// built into cargo's target dir and used in strict mode
/// (`DMALOAD_EMU_STRICT=1`). `Err` says why there is no driver (no C
/// compiler, say); the tests then skip with it.
pub fn cuda_driver() -> Result<(), String> {
    static CHOSEN: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    CHOSEN.get_or_init(choose_cuda_driver).clone()
}

fn choose_cuda_driver() -> Result<(), String> {
    if std::env::var_os("DMALOAD_LIBCUDA").is_some_and(|path| !path.is_empty()) {
        return Ok(());
    }
    let forced = std::env::var_os("DMALOAD_TEST_CUDA").is_some_and(|v| v == "emulator");
    if !forced && installed_libcuda_loads() {
        return Ok(());
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda-emu");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/cuda-emu/build.sh");
    let built = std::process::Command::new("bash").arg(&script).arg(&dir).output();
    match built {
        Ok(out) if out.status.success() => {}
        Ok(out) => {
            return Err(format!(
                "the CUDA emulator did not build: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
        Err(err) => return Err(format!("bash {} could not run: {err}", script.display())),
    }
    // Set before any CUDA call in this process (this runs inside the
    // OnceLock every CUDA test passes first), and inherited by the
    // processes the tests start.
    std::env::set_var("DMALOAD_LIBCUDA", dir.join("libcuda.so.1"));
    if std::env::var_os("DMALOAD_EMU_STRICT").is_none() {
        std::env::set_var("DMALOAD_EMU_STRICT", "1");
    }
    Ok(())
}

/// Whether the dynamic loader finds a `libcuda.so.1`, asked without dmaload.
pub fn installed_libcuda_loads() -> bool {
    // SAFETY: a NUL-terminated name; the handle is closed below and no
    // symbol from it is used.
    let handle = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return false;
    }
    // SAFETY: `handle` came from the dlopen above and is not used after.
    unsafe { libc::dlclose(handle) };
    true
}
