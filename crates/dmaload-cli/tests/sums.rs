//! `dmaload sums` against the real tools (what `sha256sum *` / `b3sum *`
//! list in a directory, a Hugging Face snapshot's links included), and
//! every file the CLI creates against another user's symlinks planted in a
//! shared directory: the victim stays intact, the command fails clearly or
//! succeeds without following the link, and no temporary file is left.

mod common;

use std::ffi::OsStr;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{as_nobody, dmaload, entries_besides, output_or_hang, skip, victim};

/// What `TOOL *` prints (stdout: the lines of what it could sum) in `dir`,
/// the shell's `*` in the C locale.
fn tool_star(tool: &str, dir: &Path) -> Vec<u8> {
    let out = Command::new("sh")
        .args(["-c", &format!("{tool} *")])
        .env("LC_ALL", "C")
        .current_dir(dir)
        .output()
        .unwrap();
    out.stdout
}

/// A Hugging Face cache entry: `blobs/<hash>` files, and
/// `snapshots/<rev>/` made of relative links into `../../blobs/` (a
/// subfolder's into `../../../blobs/`), plus a hidden file, a dangling
/// link and a subdirectory. Returns the snapshot directory.
fn hf_snapshot(root: &Path) -> PathBuf {
    let blobs = root.join("blobs");
    let snapshot = root.join("snapshots").join("0123abcd");
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::create_dir_all(snapshot.join("unet")).unwrap();
    for (i, name) in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "config.json",
        ".gitattributes",
    ]
    .iter()
    .enumerate()
    {
        let blob = format!("{:040x}", i + 1);
        common::sample(&blobs, OsStr::new(&blob), 50_000 * (i + 1) + 3);
        symlink(format!("../../blobs/{blob}"), snapshot.join(name)).unwrap();
    }
    symlink(
        "../../../blobs/0000000000000000000000000000000000000001",
        snapshot.join("unet/model.safetensors"),
    )
    .unwrap();
    symlink("../../blobs/missing", snapshot.join("dangling.bin")).unwrap();
    snapshot
}

/// `dmaload sums DIR` writes byte for byte what `sha256sum *` (and with
/// `--digest blake3`, `b3sum *`) prints in DIR, for a Hugging Face
/// snapshot whose files are all symlinks into `blobs/`; it names what it
/// left out (the subdirectory, the dangling link, the hidden file), and
/// both the real `-c` and `load --verify` accept what it wrote.
#[test]
fn sums_of_a_hugging_face_snapshot_lists_what_sha256sum_star_lists() {
    let scratch = common::open_scratch("dmaload-sums-hf");
    let snapshot = hf_snapshot(scratch.path());
    let out = output_or_hang(dmaload().arg("sums").arg(&snapshot));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Compared with what `sha256sum *` prints where there is no sums file.
    let written = std::fs::read(snapshot.join("SHA256SUMS")).unwrap();
    std::fs::remove_file(snapshot.join("SHA256SUMS")).unwrap();
    let star = tool_star("sha256sum", &snapshot);
    assert_eq!(String::from_utf8_lossy(&written), String::from_utf8_lossy(&star));
    std::fs::write(snapshot.join("SHA256SUMS"), &written).unwrap();
    assert_eq!(written.iter().filter(|&&b| b == b'\n').count(), 3, "three files: two shards and the config");
    let stderr = String::from_utf8_lossy(&out.stderr);
    for left_out in
        ["unet: a directory", "dangling.bin: a symlink to nothing", ".gitattributes: a hidden name"]
    {
        assert!(stderr.contains(left_out), "{left_out:?} not in {stderr}");
    }
    let check = Command::new("sha256sum").args(["-c", "SHA256SUMS"]).current_dir(&snapshot).output().unwrap();
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stdout));
    let shard = snapshot.join("model-00001-of-00002.safetensors");
    let load = output_or_hang(dmaload().args(["load", "--verify"]).arg(&shard));
    assert!(load.status.success(), "{}", String::from_utf8_lossy(&load.stderr));

    if !common::have("b3sum") {
        return skip(
            "sums_of_a_hugging_face_snapshot_lists_what_sha256sum_star_lists",
            "b3sum not installed",
        );
    }
    let out = output_or_hang(dmaload().args(["sums", "--digest", "blake3"]).arg(&snapshot));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The sums files themselves are left out, as a fresh `b3sum *` would.
    std::fs::remove_file(snapshot.join("SHA256SUMS")).unwrap();
    let b3 = std::fs::rename(snapshot.join("B3SUMS"), scratch.path().join("B3SUMS"));
    b3.unwrap();
    assert_eq!(std::fs::read(scratch.path().join("B3SUMS")).unwrap(), tool_star("b3sum", &snapshot));
}

/// Names each tool escapes its own way: `sha256sum` writes a carriage
/// return as `\r` (and starts the line with a backslash), `b3sum` writes it
/// as it is; a newline and a backslash both escape. `dmaload sums` writes
/// each tool's own bytes, and each tool's `-c` reads them back.
#[test]
fn sums_escapes_names_as_each_tool_does() {
    let scratch = common::open_scratch("dmaload-sums-names");
    let dir = scratch.path();
    let names = ["carriage\rreturn", "new\nline", "back\\slash", "with space", "*star"];
    for name in names {
        common::sample(dir, OsStr::new(name), 10_000 + name.len());
    }
    for (tool, digest, sums) in [("sha256sum", "sha256", "SHA256SUMS"), ("b3sum", "blake3", "B3SUMS")] {
        if !common::have(tool) {
            skip("sums_escapes_names_as_each_tool_does", &format!("{tool} not installed"));
            continue;
        }
        let out = output_or_hang(dmaload().args(["sums", "--digest", digest]).arg(dir));
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let written = std::fs::read(dir.join(sums)).unwrap();
        std::fs::remove_file(dir.join(sums)).unwrap();
        assert_eq!(
            String::from_utf8_lossy(&written),
            String::from_utf8_lossy(&tool_star(tool, dir)),
            "{tool}"
        );
        std::fs::write(dir.join(sums), &written).unwrap();
        let check = Command::new(tool).args(["-c", sums]).current_dir(dir).output().unwrap();
        assert!(check.status.success(), "{tool} -c: {}", String::from_utf8_lossy(&check.stderr));
        std::fs::remove_file(dir.join(sums)).unwrap();
    }
}

/// In a directory others may write (0777, and sticky 1777 like /tmp),
/// nobody plants a symlink to the caller's file at the temporary name
/// today's `dmaload sums` uses (`.SHA256SUMS.<pid>.tmp`, its pid made 1 by
/// running it as the first process of a new PID namespace): the file stays
/// intact, the sums file is written, the planted link is left as it was,
/// and no temporary file remains. A directory planted at `SHA256SUMS`
/// makes `sums` fail, naming it, again with no temporary file left.
#[test]
fn sums_never_writes_through_a_symlink_another_user_planted() {
    let test = "sums_never_writes_through_a_symlink_another_user_planted";
    let Some(_) = as_nobody(test, "true") else { return };
    if !Command::new("unshare").args(["--pid", "--fork", "true"]).status().is_ok_and(|s| s.success()) {
        return skip(test, "unshare --pid cannot make a PID namespace here");
    }
    for mode in [0o777, 0o1777] {
        let scratch = common::open_scratch("dmaload-sums-planted");
        let victim = victim(scratch.path());
        let dir = scratch.path().join("shared");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).unwrap();
        for name in ["a", "b"] {
            common::sample(&dir, OsStr::new(name), 70_000);
        }
        let planted = dir.join(".SHA256SUMS.1.tmp");
        let ln = as_nobody(test, "ln").unwrap().arg("-s").arg(&victim).arg(&planted).status().unwrap();
        assert!(ln.success());
        let out = output_or_hang(
            Command::new("unshare")
                .args(["--pid", "--fork"])
                .arg(env!("CARGO_BIN_EXE_dmaload"))
                .arg("sums")
                .arg(&dir),
        );
        let now = std::fs::read(&victim).unwrap();
        assert!(now == b"precious\n", "mode {mode:o}: the victim was written ({} bytes now)", now.len());
        assert!(out.status.success(), "mode {mode:o}: {}", String::from_utf8_lossy(&out.stderr));
        let coreutils = Command::new("sha256sum").args(["a", "b"]).current_dir(&dir).output().unwrap();
        assert_eq!(std::fs::read(dir.join("SHA256SUMS")).unwrap(), coreutils.stdout);
        assert_eq!(std::fs::read_link(&planted).unwrap(), victim, "the planted link was changed");
        assert_eq!(
            entries_besides(&dir, &["a", "b", "SHA256SUMS", ".SHA256SUMS.1.tmp"]),
            Vec::<String>::new()
        );

        // Something else at the target name: a clear failure, nothing left.
        std::fs::remove_file(dir.join("SHA256SUMS")).unwrap();
        let mkdir = as_nobody(test, "mkdir").unwrap().arg(dir.join("SHA256SUMS")).status().unwrap();
        assert!(mkdir.success());
        let out = output_or_hang(dmaload().arg("sums").arg(&dir));
        assert!(!out.status.success(), "mode {mode:o}: a directory at SHA256SUMS was replaced");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("SHA256SUMS") && stderr.contains("directory"), "{stderr}");
        assert_eq!(
            entries_besides(&dir, &["a", "b", "SHA256SUMS", ".SHA256SUMS.1.tmp"]),
            Vec::<String>::new()
        );
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious\n");
    }
}
