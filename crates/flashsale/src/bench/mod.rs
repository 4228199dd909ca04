//! `flashsale bench`: purchases per second under wrk, against a PING endpoint of the same
//! service measured in the same run.
//!
//! Every strategy's service runs in this process on one private Redis and one SQLite file
//! (or REDIS_URL / DATABASE_URL). wrk, a separate process, drives each target in turn for
//! `--duration`, and the rounds are interleaved so that the shared machine's noise falls on
//! every target alike; the report quotes medians over rounds.
//!
//! - The floor is `GET /ping`: the same HTTP stack and one Redis round trip.
//! - A purchase is `POST /api/coupons/{id}/seckill` by a buyer never seen before, against
//!   a coupon whose stock outlasts the run, so every request is a full sale.

mod chart;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use serde::{Deserialize, Serialize};

use crate::config::{Sandbox, StoreArgs, StrategyArgs};
use crate::model::MAX_STOCK;
use crate::strategy::Strategy;
use crate::{CliResult, Service};

const PURCHASE_SCRIPT: &str = include_str!("purchase.lua");
const REPORT_SCRIPT: &str = include_str!("report.lua");
/// The marker of the JSON line report.lua prints.
const WRK_MARKER: &str = "FLASHSALE_WRK ";

/// Flags of `flashsale bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Open connections (wrk -c).
    #[arg(long, default_value_t = 256)]
    pub connections: u32,
    /// wrk threads (wrk -t).
    #[arg(long, default_value_t = 2)]
    pub threads: u32,
    /// How long each measurement runs, in whole seconds (1s to 10m).
    #[arg(long, value_parser = crate::config::parse_duration, default_value = "5s")]
    pub duration: std::time::Duration,
    /// Interleaved rounds; figures are medians over them.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Strategies to measure besides the PING floor: one, several separated by commas, or
    /// all (as `load --strategy`).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "all")]
    pub strategy: Vec<crate::load::StrategyChoice>,
    /// Run no order worker: measure reservations alone, with orders left queued in the
    /// stream. Shows what storing orders during the peak costs.
    #[arg(long)]
    pub no_worker: bool,
    /// Run the private Redis without its append-only file. By default it writes one,
    /// synced every second, as `serve`'s embedded mode does; compare the two runs to see
    /// what persistence costs.
    #[arg(long)]
    pub no_aof: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also draw the median requests/s as an SVG bar chart at this path.
    #[arg(long)]
    pub chart: Option<PathBuf>,
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub knobs: StrategyArgs,
}

/// What one wrk run measured.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct WrkRun {
    /// Requests completed.
    pub requests: u64,
    /// Wall time, µs.
    pub duration_us: u64,
    /// Answers that were not 2xx: for purchases, anything but a sale.
    pub non_2xx: u64,
    /// Connect, read, write and timeout errors.
    pub socket_errors: u64,
    /// Median latency, µs.
    pub p50_us: u64,
    /// 99th percentile latency, µs.
    pub p99_us: u64,
    /// Slowest request, µs.
    pub max_us: u64,
}

impl WrkRun {
    /// Requests per second.
    pub fn rps(&self) -> f64 {
        self.requests as f64 / (self.duration_us.max(1) as f64 / 1e6)
    }
}

/// The medians of one target over the rounds.
#[derive(Debug, Clone, Serialize)]
pub struct TargetResult {
    /// "ping", or a strategy's name.
    pub target: String,
    /// Median requests per second.
    pub rps: f64,
    /// Median of the rounds' median latency, ms.
    pub p50_ms: f64,
    /// Median of the rounds' p99 latency, ms.
    pub p99_ms: f64,
    /// Slowest request of any round, ms.
    pub max_ms: f64,
    /// Non-2xx answers over all rounds.
    pub non_2xx: u64,
    /// Socket errors over all rounds.
    pub socket_errors: u64,
    /// Median seconds the order worker still needed, after a run ended, to store the
    /// run's sales: the peak the stream absorbed.
    pub drain_s: f64,
    /// Every round, in order.
    pub rounds: Vec<WrkRun>,
}

/// The benchmark's report.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// wrk connections.
    pub connections: u32,
    /// wrk threads.
    pub threads: u32,
    /// Seconds per measurement.
    pub seconds: u32,
    /// Rounds.
    pub rounds: u32,
    /// The Redis the services ran on: its persistence, or that it was REDIS_URL.
    pub redis: String,
    /// The PING floor first, then each strategy.
    pub targets: Vec<TargetResult>,
}

impl BenchReport {
    fn find(&self, target: &str) -> Option<&TargetResult> {
        self.targets.iter().find(|t| t.target == target)
    }

    /// `target`'s median requests/s as a ratio to `baseline`'s.
    pub fn ratio(&self, target: &str, baseline: &str) -> Option<f64> {
        Some(self.find(target)?.rps / self.find(baseline)?.rps)
    }

    /// The median over rounds of `target`'s requests/s as a ratio to `baseline`'s in the
    /// same round. Each round measures both within seconds of each other, so this ratio
    /// is less exposed to the machine's drift than the ratio of medians.
    pub fn round_ratio(&self, target: &str, baseline: &str) -> Option<f64> {
        let (target, baseline) = (self.find(target)?, self.find(baseline)?);
        let mut ratios: Vec<f64> = target
            .rounds
            .iter()
            .zip(&baseline.rounds)
            .map(|(t, b)| t.rps() / b.rps())
            .collect();
        ratios.sort_by(f64::total_cmp);
        ratios.get(ratios.len() / 2).copied()
    }

    /// The table.
    pub fn table(&self) -> String {
        let mut out = format!(
            "wrk -t{} -c{} -d{}s, {} interleaved rounds, medians; redis: {}\n\n",
            self.threads, self.connections, self.seconds, self.rounds, self.redis
        );
        out.push_str(&format!(
            "{:<12} {:>10} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>7} {:>9}\n",
            "target",
            "req/s",
            "p50 ms",
            "p99 ms",
            "max ms",
            "× ping",
            "× lua",
            "non-2xx",
            "errors",
            "drain s"
        ));
        for t in &self.targets {
            let ratio = |base: &str| {
                self.ratio(&t.target, base)
                    .map(|r| format!("{r:.2}"))
                    .unwrap_or_else(|| "-".into())
            };
            out.push_str(&format!(
                "{:<12} {:>10.0} {:>9.2} {:>9.2} {:>9.1} {:>9} {:>8} {:>8} {:>7} {:>9.1}\n",
                t.target,
                t.rps,
                t.p50_ms,
                t.p99_ms,
                t.max_ms,
                ratio("ping"),
                ratio("lua"),
                t.non_2xx,
                t.socket_errors,
                t.drain_s
            ));
        }
        if let (Some(ratio), Some(per_round), Some(lua)) = (
            self.ratio("lua", "ping"),
            self.round_ratio("lua", "ping"),
            self.find("lua"),
        ) {
            let met = |ok: bool| if ok { "met" } else { "MISSED" };
            out.push_str(&format!(
                "\ntarget: lua ≥ 0.80 × ping req/s: {ratio:.2} of medians, {per_round:.2} median per round ({}); \
                 lua p99 ≤ 50 ms: {:.1} ms ({})\n",
                met(per_round >= 0.8),
                lua.p99_ms,
                met(lua.p99_ms <= 50.0)
            ));
        }
        out
    }
}

/// `flashsale bench`.
pub async fn run(args: BenchArgs) -> CliResult {
    let seconds = u32::try_from(args.duration.as_secs()).unwrap_or(u32::MAX);
    if args.duration.subsec_millis() != 0 || !(1..=600).contains(&seconds) {
        return Err("--duration must be whole seconds, from 1s to 10m".into());
    }
    if args.connections == 0 || args.threads == 0 || args.rounds == 0 {
        return Err("--connections, --threads and --rounds must be at least 1".into());
    }
    if args.threads > args.connections {
        return Err("--threads must not exceed --connections".into());
    }
    check_wrk().await?;
    let sandbox = Sandbox::new(&args.store, !args.no_aof).await?;
    eprintln!("flashsale bench: using {}", sandbox.describe());
    let script = write_script(sandbox.scratch())?;
    let http = reqwest::Client::new();
    let mut services = Vec::new();
    let chosen: Vec<Strategy> = args
        .strategy
        .iter()
        .flat_map(|choice| choice.strategies())
        .collect();
    let mut strategies = vec![Strategy::Lua];
    strategies.extend(chosen.iter().copied().filter(|s| *s != Strategy::Lua));
    for strategy in strategies {
        let mut config = sandbox.config(strategy, &args.knobs)?;
        if args.no_worker || !services.is_empty() {
            // One worker stores every strategy's orders (it watches every coupon): several
            // workers on one SQLite file would only queue on its write lock.
            config.worker = None;
        }
        let service = Service::start(config).await?;
        let coupon =
            crate::load::create_coupon(&http, &service.base_url(), strategy, MAX_STOCK).await?;
        services.push((strategy, service, coupon));
    }
    let Some((_, lua_service, _)) = services.first() else {
        return Err("no service started".into());
    };
    let ping_url = format!("{}/ping", lua_service.base_url());

    let mut targets: Vec<Target> = vec![Target {
        name: "ping".into(),
        url: ping_url,
        method: "GET",
        stats_url: None,
        runs: Vec::new(),
        drains: Vec::new(),
    }];
    for (strategy, service, coupon) in &services {
        if chosen.contains(strategy) {
            targets.push(Target {
                name: strategy.name().into(),
                url: format!("{}/api/coupons/{coupon}/seckill", service.base_url()),
                method: "POST",
                stats_url: (!args.no_worker)
                    .then(|| format!("{}/api/coupons/{coupon}/stats", service.base_url())),
                runs: Vec::new(),
                drains: Vec::new(),
            });
        }
    }
    // A short warm-up per target: connections, script caches, the allocator.
    for target in &targets {
        wrk(&args, &script, target, 1, 1).await?;
    }
    let mut first_user: u64 = 1_000_000_000_000;
    let progress = indicatif::ProgressBar::new(u64::from(args.rounds) * targets.len() as u64);
    if args.json {
        progress.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    for _ in 0..args.rounds {
        for target in &mut targets {
            first_user += 100_000_000_000;
            let run = wrk(&args, &script, target, seconds, first_user).await?;
            target.runs.push(run);
            let drain = wait_for_drain(&http, target).await?;
            target.drains.push(drain);
            progress.inc(1);
        }
    }
    progress.finish_and_clear();
    for (_, service, _) in services {
        service.shutdown().await;
    }

    let report = BenchReport {
        connections: args.connections,
        threads: args.threads,
        seconds,
        rounds: args.rounds,
        redis: match (&args.store.redis_url, args.no_aof) {
            (Some(_), _) => "REDIS_URL".to_owned(),
            (None, false) => "private, appendonly yes, appendfsync everysec".to_owned(),
            (None, true) => "private, no persistence".to_owned(),
        },
        targets: targets
            .into_iter()
            .map(|target| summarize(target.name, target.runs, target.drains))
            .collect(),
    };
    if let Some(path) = &args.chart {
        chart::draw(&report, path)?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.table());
    }
    Ok(ExitCode::SUCCESS)
}

fn summarize(target: String, rounds: Vec<WrkRun>, drains: Vec<f64>) -> TargetResult {
    let median = |mut values: Vec<f64>| {
        values.sort_by(f64::total_cmp);
        values.get(values.len() / 2).copied().unwrap_or(0.0)
    };
    let ms = |us: u64| us as f64 / 1000.0;
    TargetResult {
        rps: median(rounds.iter().map(WrkRun::rps).collect()),
        p50_ms: median(rounds.iter().map(|r| ms(r.p50_us)).collect()),
        p99_ms: median(rounds.iter().map(|r| ms(r.p99_us)).collect()),
        max_ms: rounds.iter().map(|r| ms(r.max_us)).fold(0.0, f64::max),
        non_2xx: rounds.iter().map(|r| r.non_2xx).sum(),
        socket_errors: rounds.iter().map(|r| r.socket_errors).sum(),
        drain_s: median(drains),
        target,
        rounds,
    }
}

fn write_script(dir: &Path) -> std::io::Result<PathBuf> {
    let path = dir.join("flashsale-wrk.lua");
    // /ping ignores the buyer header, so one script serves every target.
    std::fs::write(&path, format!("{PURCHASE_SCRIPT}\n{REPORT_SCRIPT}"))?;
    Ok(path)
}

async fn check_wrk() -> Result<(), String> {
    match tokio::process::Command::new("wrk").arg("--version").output().await {
        Ok(_) => Ok(()),
        Err(_) => Err("wrk is not installed; install it with `apt-get install wrk` (./dev bench-flashsale does)".into()),
    }
}

/// One thing wrk drives: the PING floor or a strategy's purchase endpoint.
struct Target {
    name: String,
    url: String,
    method: &'static str,
    /// The coupon's stats URL, for purchase targets.
    stats_url: Option<String>,
    runs: Vec<WrkRun>,
    drains: Vec<f64>,
}

/// Waits until the order worker has stored every sale of the target's coupon, so that one
/// run's backlog does not eat into the next run's CPU. Returns the seconds it took.
async fn wait_for_drain(http: &reqwest::Client, target: &Target) -> Result<f64, String> {
    let Some(url) = &target.stats_url else {
        return Ok(0.0);
    };
    let started = std::time::Instant::now();
    loop {
        let text = http
            .get(url)
            .send()
            .await
            .map_err(|err| format!("stats: {err}"))?
            .text()
            .await
            .map_err(|err| format!("stats: {err}"))?;
        let stats: crate::http::CouponStats =
            serde_json::from_str(&text).map_err(|err| format!("stats {text:?}: {err}"))?;
        if stats.orders_queued == 0 {
            return Ok(started.elapsed().as_secs_f64());
        }
        if started.elapsed() > std::time::Duration::from_secs(300) {
            return Err(format!(
                "{}: {} orders still queued after 300 s",
                target.name, stats.orders_queued
            ));
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

async fn wrk(
    args: &BenchArgs,
    script: &Path,
    target: &Target,
    seconds: u32,
    first_user: u64,
) -> Result<WrkRun, String> {
    let output = tokio::process::Command::new("wrk")
        .arg(format!("-t{}", args.threads))
        .arg(format!("-c{}", args.connections))
        .arg(format!("-d{seconds}s"))
        .arg("--timeout")
        .arg("10s")
        .arg("-s")
        .arg(script)
        .arg(&target.url)
        .arg("--")
        .arg(first_user.to_string())
        .arg(target.method)
        .output()
        .await
        .map_err(|err| format!("running wrk: {err}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout
        .lines()
        .find_map(|line| line.strip_prefix(WRK_MARKER))
        .ok_or_else(|| {
            format!(
                "wrk printed no report ({}):\n{stdout}\n{}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            )
        })?;
    serde_json::from_str(line).map_err(|err| format!("wrk's report {line:?}: {err}"))
}
