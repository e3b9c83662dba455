//! What the `dmaload` command users install links and offers: no plotting
//! library, no benchmark crate and none of the core's benchmark baselines
//! (those are the `dmaload-bench` binary's); `dmaload bench` only says
//! where the benchmarks went.

use std::process::Command;

fn dmaload() -> Command {
    Command::new(env!("CARGO_BIN_EXE_dmaload"))
}

/// `cargo tree` of this package's normal dependencies with their features,
/// offline (the lock file and the registry cache the build just used).
fn tree() -> String {
    let out = Command::new(env!("CARGO"))
        .args(["tree", "--offline", "--prefix", "none", "-e", "normal,features", "-p", "dmaload-cli"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(out.status.success(), "cargo tree: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_command_links_no_plotting_library_and_no_baselines() {
    let tree = tree();
    assert!(tree.lines().any(|l| l.starts_with("dmaload v")), "{tree}");
    for crate_name in ["plotters", "dejavu", "png", "dmaload-bench"] {
        let found: Vec<&str> = tree.lines().filter(|l| l.starts_with(&format!("{crate_name} v"))).collect();
        assert!(found.is_empty(), "dmaload-cli depends on {crate_name}: {found:?}");
    }
    let baselines: Vec<&str> = tree.lines().filter(|l| l.contains("feature \"baselines\"")).collect();
    assert!(baselines.is_empty(), "dmaload-cli turns on the core's baselines: {baselines:?}");
}

#[test]
fn bench_names_the_binary_the_benchmarks_moved_to() {
    let out = dmaload().args(["bench", "load", "--repeat", "1", "model.safetensors"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("moved to the dmaload-bench binary")
            && stderr.contains("dmaload-bench load --repeat 1 model.safetensors"),
        "{stderr}"
    );
    // Not offered in the help any more.
    let help = dmaload().arg("--help").output().unwrap();
    assert!(
        !String::from_utf8_lossy(&help.stdout).contains("bench"),
        "{}",
        String::from_utf8_lossy(&help.stdout)
    );
}
