//! Runs the programs in examples/ as a user would: built beside the tests, named a store
//! by REDIS_URL (whatever the store: the programs change only by their URL).

use std::path::PathBuf;
use std::process::Command;

/// Runs `examples/<name>` with `REDIS_URL=url`; returns its stdout, failing the test with
/// its output if it did not exit 0. `feature` is the Cargo feature the store needs, for
/// the hint when the program was built without it.
pub fn run(name: &str, url: &str, feature: Option<&str>) -> String {
    let build = match feature {
        Some(feature) => format!("cargo build -p distlock --features {feature} --examples"),
        None => "cargo build -p distlock --examples".to_owned(),
    };
    // This test runs from target/<profile>/deps; cargo puts examples beside it.
    let mut path: PathBuf = std::env::current_exe().expect("test executable");
    path.pop();
    path.pop();
    path.push("examples");
    path.push(name);
    assert!(
        path.exists(),
        "{} is not built: run `{build}` first (cargo test of the package builds them)",
        path.display()
    );
    let output = Command::new(&path)
        .env("REDIS_URL", url)
        .output()
        .unwrap_or_else(|err| panic!("run {}: {err}", path.display()));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    if let Some(feature) = feature {
        assert!(
            !stderr.contains(&format!("built without its `{feature}` feature")),
            "{name} was built without the `{feature}` feature: run `{build}` first"
        );
    }
    assert!(
        output.status.success(),
        "{name} failed: {}\n{stdout}{stderr}",
        output.status
    );
    stdout
}

/// The cron job runs once per period: a second run within it skips.
pub fn cron_runs_once(url: &str, feature: Option<&str>) {
    let first = run("cron_once", url, feature);
    assert!(first.contains("report done"), "{first}");
    let second = run("cron_once", url, feature);
    assert!(second.contains("skipped"), "{second}");
}

/// The fenced write refuses the stale writer, and the balance keeps every good write.
pub fn fenced_write_refuses_the_stale_writer(url: &str, feature: Option<&str>) {
    let out = run("fenced_write", url, feature);
    assert!(out.contains("B adds 10: written"), "{out}");
    assert!(out.contains("A wakes and takes 100: refused"), "{out}");
    assert!(out.contains("A releases: AlreadyLost"), "{out}");
    assert!(out.contains("balance: 110"), "{out}");
}

/// The worker pool does every job.
pub fn worker_pool_does_every_job(url: &str, feature: Option<&str>) {
    let out = run("worker_pool", url, feature);
    assert!(out.contains("12 jobs: 12 done, others: []"), "{out}");
}

/// All three, on the store at `url`.
pub fn all_run_unchanged(url: &str, feature: Option<&str>) {
    cron_runs_once(url, feature);
    fenced_write_refuses_the_stale_writer(url, feature);
    worker_pool_does_every_job(url, feature);
}
