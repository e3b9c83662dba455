//! The C library from C: installs it (install.sh: library, header,
//! dmaload.pc) under a scratch prefix, builds examples/c/load.c against the
//! shared library through pkg-config and tests/c/capi_test.c against the
//! static one, with the system C compiler (`cc`), and runs both.

#[path = "../../dmaload/tests/common/garage.rs"]
mod garage;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use garage::{pattern, Garage};

const WARNINGS: [&str; 4] = ["-std=c11", "-Wall", "-Wextra", "-Werror"];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The directory cargo built the libraries into: the test's own `deps`
/// (a `cargo test` alone does not copy them up to the profile directory).
fn built_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap().to_owned();
    assert!(deps.join("libdmaload_capi.a").exists(), "libdmaload_capi.a is not in {}", deps.display());
    deps
}

fn run(cmd: &mut Command) -> Output {
    let out =
        cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e} (CI installs cc and pkg-config)"));
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    out
}

/// The library, header and dmaload.pc installed under a scratch prefix.
fn install(scratch: &Path) -> PathBuf {
    let prefix = scratch.join("prefix");
    let script = repo().join("crates/dmaload-capi/install.sh");
    run(Command::new("bash").arg(script).arg(&prefix).arg(built_dir()));
    prefix
}

fn pkg_config(prefix: &Path, args: &[&str]) -> Vec<String> {
    let out = run(Command::new("pkg-config")
        .args(args)
        .arg("dmaload")
        .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig")));
    String::from_utf8(out.stdout).unwrap().split_whitespace().map(str::to_owned).collect()
}

/// examples/c/load.c built against the shared library installed under
/// `scratch` through pkg-config.
fn build_example(scratch: &Path) -> PathBuf {
    let prefix = install(scratch);
    let exe = scratch.join("load");
    run(Command::new("cc")
        .args(WARNINGS)
        .arg(repo().join("examples/c/load.c"))
        .args(pkg_config(&prefix, &["--cflags", "--libs"]))
        .arg(format!("-Wl,-rpath,{}", prefix.join("lib").display()))
        .arg("-o")
        .arg(&exe));
    exe
}

#[test]
fn the_c_example_prints_the_files_xxh3() {
    let scratch = tempfile::tempdir().unwrap();
    let exe = build_example(scratch.path());
    let file = scratch.path().join("data");
    let bytes: Vec<u8> =
        (0..(5u32 << 20) + 17).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    std::fs::write(&file, &bytes).unwrap();
    let out = run(Command::new(&exe).arg(&file));
    let stdout = String::from_utf8(out.stdout).unwrap();
    eprint!("{stdout}");
    let last = stdout.lines().last().unwrap();
    assert_eq!(last, format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes)));
    // A missing file: the message names it, the exit status is 1.
    let out = Command::new(&exe).arg(scratch.path().join("missing")).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing: No such file"), "{out:?}");
}

/// An `s3://` URL as the path: `dmaload_load` into host memory, and
/// `dmaload_load_dmabuf` into a dma-buf where the kernel has one (the
/// QEMU guest's run, tests/vm/ci.sh); here without one, the error is the
/// missing dma-buf producer's, not a file's.
#[test]
fn the_c_library_loads_an_object_from_s3() {
    let Some(garage) = Garage::start("the_c_library_loads_an_object_from_s3") else { return };
    let scratch = tempfile::tempdir().unwrap();
    let exe = build_example(scratch.path());
    let bytes = pattern((3 << 20) + 123, 7);
    garage.put("c/weights.bin", &bytes);
    let url = format!("s3://{}/c/weights.bin", garage::BUCKET);
    let example = |args: &[&str]| {
        Command::new(&exe)
            .args(args)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            // No ~/.aws of the machine's: only the server's settings.
            .env("HOME", scratch.path())
            .envs(garage.env())
            .output()
            .unwrap()
    };
    let out = example(&[&url]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(stdout.lines().last().unwrap(), format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes)));
    let out = example(&[&url, "dmabuf"]);
    if out.status.success() {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(stdout.lines().last().unwrap(), format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes)));
    } else {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("dmaload_load_dmabuf") && !stderr.contains("No such file"), "{stderr}");
        eprintln!("no dma-buf producer here: {stderr}");
    }
    // A missing key: ENOENT, the message naming the bucket and key.
    let out = example(&[&format!("s3://{}/c/absent.bin", garage::BUCKET)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        stderr.contains("c/absent.bin") && stderr.contains(&format!("errno {}", libc::ENOENT)),
        "{stderr}"
    );
}

#[test]
fn the_c_test_program_passes_against_the_static_library() {
    let scratch = tempfile::tempdir().unwrap();
    let prefix = install(scratch.path());
    let exe = scratch.path().join("capi_test");
    // The archive itself, then what it needs from the system (Libs.private).
    let system_libs: Vec<String> = pkg_config(&prefix, &["--static", "--libs-only-l"])
        .into_iter()
        .filter(|l| l != "-ldmaload_capi")
        .collect();
    run(Command::new("cc")
        .args(WARNINGS)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/capi_test.c"))
        .args(pkg_config(&prefix, &["--cflags"]))
        .arg(prefix.join("lib/libdmaload_capi.a"))
        .args(system_libs)
        .arg("-o")
        .arg(&exe));
    let dir = tempfile::tempdir_in(
        std::env::var_os("DMALOAD_TEST_DIR").map_or_else(std::env::temp_dir, PathBuf::from),
    )
    .unwrap();
    let out = run(Command::new(&exe).arg(dir.path()));
    let stdout = String::from_utf8(out.stdout).unwrap();
    eprint!("{stdout}");
    assert!(stdout.lines().last().unwrap().ends_with(" passed, 0 failed"), "{stdout}");
}
