//! `flashsale load`: the load generator, and the proof that the rules hold.
//!
//! For each strategy it creates a coupon with `stock` units, then sends `requests`
//! purchases from `users` distinct users at `concurrency`. Every user buys at least once
//! when `requests ≥ users`; the surplus are retries of random users, sent on purpose so
//! that one-per-user is tested too. When the requests are done it waits for the order
//! worker to drain and checks:
//!
//! - oversold = sold − stock is 0;
//! - no user got more than one 201;
//! - the orders in SQL equal the sales Redis counted (order events in the stream);
//! - what the buyers were told (201s) equals what Redis sold (stock − remaining).

use std::collections::{BTreeMap, HashMap};
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use serde_json::json;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use crate::config::{Sandbox, StoreArgs, StrategyArgs};
use crate::http::{CouponStats, USER_HEADER};
use crate::model::MAX_STOCK;
use crate::strategy::Strategy;
use crate::{CliResult, Service};

/// How often the drain wait asks the service for its queue length.
const DRAIN_POLL: Duration = Duration::from_millis(50);

/// Flags of `flashsale load`.
#[derive(Debug, Clone, clap::Args)]
pub struct LoadArgs {
    /// A running service to load (e.g. http://127.0.0.1:8080). Unset: one in-process
    /// service per strategy, on a private Redis and a temporary SQLite file unless
    /// REDIS_URL / DATABASE_URL are set.
    #[arg(long)]
    pub url: Option<String>,
    /// lua, lock, segmented, unsafe, or all (in-process only) [default: all; with --url,
    /// the running service's strategy].
    #[arg(long)]
    pub strategy: Option<StrategyChoice>,
    /// Units of the coupon put on sale.
    #[arg(long, default_value_t = 500)]
    pub stock: i64,
    /// Purchase requests to send per strategy.
    #[arg(long, default_value_t = 6000)]
    pub requests: usize,
    /// Distinct buyers; requests beyond this are deliberate retries.
    #[arg(long, default_value_t = 4000)]
    pub users: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 256)]
    pub concurrency: usize,
    /// Seed of the request order, to replay a run.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Longest wait for the order worker to store every sale.
    #[arg(long, value_parser = crate::config::parse_duration, default_value = "60s")]
    pub drain_timeout: Duration,
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub knobs: StrategyArgs,
}

/// One strategy, or all four.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StrategyChoice {
    /// The atomic script.
    Lua,
    /// A per-coupon lock.
    Lock,
    /// Segmented locks.
    Segmented,
    /// The unsafe control.
    Unsafe,
    /// All four, side by side.
    All,
}

impl StrategyChoice {
    /// The strategies this choice names.
    pub fn strategies(self) -> Vec<Strategy> {
        match self {
            StrategyChoice::Lua => vec![Strategy::Lua],
            StrategyChoice::Lock => vec![Strategy::Lock],
            StrategyChoice::Segmented => vec![Strategy::Segmented],
            StrategyChoice::Unsafe => vec![Strategy::Unsafe],
            StrategyChoice::All => Strategy::ALL.to_vec(),
        }
    }
}

/// The shape of one run, the same for every strategy.
#[derive(Debug, Clone, Serialize)]
pub struct LoadPlan {
    /// Units on sale.
    pub stock: i64,
    /// Requests sent.
    pub requests: usize,
    /// Distinct buyers.
    pub users: usize,
    /// Requests in flight at once.
    pub concurrency: usize,
    /// Seed of the request order.
    pub seed: u64,
    /// Longest wait for the worker to drain.
    #[serde(skip)]
    pub drain_timeout: Duration,
    /// Show a progress bar.
    #[serde(skip)]
    pub progress: bool,
}

impl LoadPlan {
    /// Checks the numbers.
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=MAX_STOCK).contains(&self.stock) {
            return Err(format!("--stock must be between 1 and {MAX_STOCK}"));
        }
        if self.requests == 0 || self.requests > 10_000_000 {
            return Err("--requests must be between 1 and 10000000".into());
        }
        if self.users == 0 || i64::try_from(self.users).is_err() {
            return Err("--users must be at least 1".into());
        }
        if !(1..=4096).contains(&self.concurrency) {
            return Err("--concurrency must be between 1 and 4096".into());
        }
        Ok(())
    }

    /// The buyer of each request, in sending order: every user once (as far as requests
    /// allow), then retries by random users, shuffled together.
    pub fn buyers(&self) -> Vec<i64> {
        let mut rng = fastrand::Rng::with_seed(self.seed);
        let distinct = self.users.min(self.requests);
        let mut buyers: Vec<i64> = (1..=distinct as i64).collect();
        while buyers.len() < self.requests {
            buyers.push(rng.i64(1..=self.users as i64));
        }
        rng.shuffle(&mut buyers);
        buyers
    }
}

/// Latency figures in milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    /// Median.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Slowest.
    pub max_ms: f64,
}

/// What one strategy's run showed.
#[derive(Debug, Clone, Serialize)]
pub struct StrategyReport {
    /// The strategy loaded.
    pub strategy: Strategy,
    /// The coupon created for the run.
    pub coupon_id: i64,
    /// Units on sale.
    pub stock: i64,
    /// 201 answers: units the buyers were told they got.
    pub sold: i64,
    /// Units Redis has left (negative if it oversold).
    pub stock_left: i64,
    /// `sold − stock` when positive: units sold that did not exist.
    pub oversold: i64,
    /// Users who got more than one 201.
    pub users_with_several_orders: i64,
    /// Order events in the stream: the sales Redis counted.
    pub sales_recorded: i64,
    /// Orders in SQL after the worker drained.
    pub orders_stored: i64,
    /// Whether the worker drained before the timeout.
    pub drained: bool,
    /// Answers by status and error code, e.g. "409 sold_out".
    pub statuses: BTreeMap<String, u64>,
    /// Requests that got no HTTP answer.
    pub transport_errors: u64,
    /// Requests per second over the whole run.
    pub throughput_rps: f64,
    /// Request latency.
    pub latency: Latency,
    /// Wall time of the requests, in seconds.
    pub elapsed_s: f64,
    /// Broken rules, empty when the run is clean.
    pub violations: Vec<String>,
}

impl StrategyReport {
    /// Whether every rule held.
    pub fn is_clean(&self) -> bool {
        self.violations.is_empty()
    }
}

/// Why a run could not be carried out (as opposed to a run that found violations).
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The plan or flags are invalid.
    #[error("{0}")]
    Invalid(String),
    /// The HTTP client failed.
    #[error("http: {0}")]
    Http(#[from] reqwest::Error),
    /// The service answered something unexpected.
    #[error("the service answered {status} to {what}: {body}")]
    Unexpected {
        /// What was asked.
        what: &'static str,
        /// The status.
        status: u16,
        /// The body.
        body: String,
    },
}

/// Runs `plan` against the service at `base_url`, which runs `strategy`: creates a coupon
/// of `plan.stock` units, then buys it.
pub async fn run_against(
    base_url: &str,
    strategy: Strategy,
    plan: &LoadPlan,
) -> Result<StrategyReport, LoadError> {
    plan.validate().map_err(LoadError::Invalid)?;
    let client = http_client(plan)?;
    let coupon_id = create_coupon(&client, base_url, strategy, plan.stock).await?;
    run_on_coupon(&client, &[base_url.to_owned()], strategy, coupon_id, plan).await
}

/// An HTTP client with a connection per concurrent request.
pub fn http_client(plan: &LoadPlan) -> Result<reqwest::Client, LoadError> {
    Ok(reqwest::Client::builder()
        .pool_max_idle_per_host(plan.concurrency)
        .timeout(Duration::from_secs(30))
        .build()?)
}

/// Sends the plan's purchases of an existing coupon, spread over every service in
/// `base_urls` (instances of one fleet), then waits for the drain and checks the rules.
pub async fn run_on_coupon(
    client: &reqwest::Client,
    base_urls: &[String],
    strategy: Strategy,
    coupon_id: i64,
    plan: &LoadPlan,
) -> Result<StrategyReport, LoadError> {
    plan.validate().map_err(LoadError::Invalid)?;
    let base_urls: Vec<&str> = base_urls
        .iter()
        .map(|url| url.trim_end_matches('/'))
        .collect();
    let Some(&first) = base_urls.first() else {
        return Err(LoadError::Invalid("no service to load".into()));
    };
    let buyers = Arc::new(plan.buyers());
    let next = Arc::new(AtomicUsize::new(0));
    let progress = if plan.progress {
        let bar = ProgressBar::new(buyers.len() as u64);
        bar.set_style(
            ProgressStyle::with_template("{prefix:>10} [{bar:40}] {pos}/{len} {per_sec}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.set_prefix(strategy.name());
        bar
    } else {
        ProgressBar::hidden()
    };
    let started = Instant::now();
    let tasks: Vec<_> = (0..plan.concurrency)
        .map(|task| {
            let url = format!(
                "{}/api/coupons/{coupon_id}/seckill",
                base_urls[task % base_urls.len()]
            );
            let (client, url, buyers, next, progress) = (
                client.clone(),
                url.clone(),
                buyers.clone(),
                next.clone(),
                progress.clone(),
            );
            tokio::spawn(async move {
                let mut tally = Tally::new();
                loop {
                    let index = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&user) = buyers.get(index) else {
                        break;
                    };
                    let sent = Instant::now();
                    let answer = client.post(&url).header(USER_HEADER, user).send().await;
                    let outcome = match answer {
                        Ok(response) => {
                            let status = response.status().as_u16();
                            let body = response.text().await.unwrap_or_default();
                            Some((status, body))
                        }
                        Err(_) => None,
                    };
                    tally.record(user, sent.elapsed(), outcome);
                    progress.inc(1);
                }
                tally
            })
        })
        .collect();
    let mut total = Tally::new();
    for task in tasks {
        match task.await {
            Ok(tally) => total.merge(tally),
            Err(err) => return Err(LoadError::Invalid(format!("a load task failed: {err}"))),
        }
    }
    let elapsed = started.elapsed();
    progress.finish_and_clear();

    let (stats, drained) = wait_for_drain(client, first, coupon_id, plan.drain_timeout).await?;
    Ok(total.report(strategy, coupon_id, plan, &stats, drained, elapsed))
}

/// Creates a coupon of `stock` units whose sale is open for the next hour.
pub async fn create_coupon(
    client: &reqwest::Client,
    base_url: &str,
    strategy: Strategy,
    stock: i64,
) -> Result<i64, LoadError> {
    let now = OffsetDateTime::now_utc();
    let format = |at: OffsetDateTime| at.format(&Rfc3339).unwrap_or_default();
    let body = json!({
        "title": format!("load test ({strategy})"),
        "stock": stock,
        "price": 100,
        "starts_at": format(now - time::Duration::seconds(1)),
        "ends_at": format(now + time::Duration::hours(1)),
    });
    let response = client
        .post(format!("{base_url}/api/coupons"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await?;
    let status = response.status().as_u16();
    let text = response.text().await?;
    let id = (status == 201)
        .then(|| serde_json::from_str::<serde_json::Value>(&text).ok())
        .flatten()
        .and_then(|value| value.get("id").and_then(|id| id.as_i64()));
    id.ok_or(LoadError::Unexpected {
        what: "creating the coupon",
        status,
        body: text,
    })
}

/// Polls the coupon's stats until no order event is queued, or the timeout passes; the
/// flag says whether it drained.
pub async fn wait_for_drain(
    client: &reqwest::Client,
    base_url: &str,
    coupon_id: i64,
    timeout: Duration,
) -> Result<(CouponStats, bool), LoadError> {
    let deadline = Instant::now() + timeout;
    loop {
        let response = client
            .get(format!("{base_url}/api/coupons/{coupon_id}/stats"))
            .send()
            .await?;
        let status = response.status().as_u16();
        let text = response.text().await?;
        let stats: CouponStats =
            serde_json::from_str(&text).map_err(|_| LoadError::Unexpected {
                what: "the stats request",
                status,
                body: text.clone(),
            })?;
        if stats.orders_queued == 0 {
            return Ok((stats, true));
        }
        if Instant::now() >= deadline {
            return Ok((stats, false));
        }
        tokio::time::sleep(DRAIN_POLL).await;
    }
}

/// One task's counts, merged at the end.
struct Tally {
    latency_us: Histogram<u64>,
    statuses: BTreeMap<String, u64>,
    transport_errors: u64,
    wins: HashMap<i64, u32>,
}

impl Tally {
    fn new() -> Self {
        Tally {
            // 1 µs to 10 min at 3 significant digits; the bounds are constants, so this
            // cannot fail.
            latency_us: Histogram::new_with_bounds(1, 600_000_000, 3)
                .unwrap_or_else(|_| Histogram::new(3).expect("3 significant digits is valid")),
            statuses: BTreeMap::new(),
            transport_errors: 0,
            wins: HashMap::new(),
        }
    }

    fn record(&mut self, user: i64, latency: Duration, outcome: Option<(u16, String)>) {
        let micros = u64::try_from(latency.as_micros())
            .unwrap_or(u64::MAX)
            .max(1);
        self.latency_us.saturating_record(micros);
        let Some((status, body)) = outcome else {
            self.transport_errors += 1;
            return;
        };
        if status == 201 {
            *self.wins.entry(user).or_default() += 1;
        }
        let code = serde_json::from_str::<serde_json::Value>(&body)
            .ok()
            .and_then(|value| {
                value
                    .get("error")
                    .and_then(|e| e.as_str())
                    .map(str::to_owned)
            });
        let key = match code {
            Some(code) => format!("{status} {code}"),
            None => status.to_string(),
        };
        *self.statuses.entry(key).or_default() += 1;
    }

    fn merge(&mut self, other: Tally) {
        let _ = self.latency_us.add(&other.latency_us);
        for (status, count) in other.statuses {
            *self.statuses.entry(status).or_default() += count;
        }
        self.transport_errors += other.transport_errors;
        for (user, wins) in other.wins {
            *self.wins.entry(user).or_default() += wins;
        }
    }

    fn report(
        self,
        strategy: Strategy,
        coupon_id: i64,
        plan: &LoadPlan,
        stats: &CouponStats,
        drained: bool,
        elapsed: Duration,
    ) -> StrategyReport {
        let sold: i64 = self.wins.values().map(|&n| i64::from(n)).sum();
        let stock_left = stats.remaining.unwrap_or(0);
        let oversold = (sold - plan.stock).max(0);
        let users_with_several_orders = self.wins.values().filter(|&&n| n > 1).count() as i64;
        let mut violations = Vec::new();
        if oversold > 0 {
            violations.push(format!("oversold {oversold} units"));
        }
        if users_with_several_orders > 0 {
            violations.push(format!(
                "{users_with_several_orders} users got more than one order"
            ));
        }
        if !drained {
            violations.push(format!(
                "{} order events still queued after the drain timeout",
                stats.orders_queued
            ));
        }
        if stats.orders_stored != stats.sales_recorded {
            violations.push(format!(
                "{} orders stored but Redis counted {} sales",
                stats.orders_stored, stats.sales_recorded
            ));
        }
        if stats.sold != Some(sold) {
            violations.push(format!(
                "buyers were told {sold} sales but Redis sold {:?}",
                stats.sold
            ));
        }
        if self.transport_errors > 0 {
            violations.push(format!("{} requests got no answer", self.transport_errors));
        }
        let ms = |micros: u64| micros as f64 / 1000.0;
        StrategyReport {
            strategy,
            coupon_id,
            stock: plan.stock,
            sold,
            stock_left,
            oversold,
            users_with_several_orders,
            sales_recorded: stats.sales_recorded,
            orders_stored: stats.orders_stored,
            drained,
            statuses: self.statuses,
            transport_errors: self.transport_errors,
            throughput_rps: plan.requests as f64 / elapsed.as_secs_f64().max(1e-9),
            latency: Latency {
                p50_ms: ms(self.latency_us.value_at_quantile(0.5)),
                p99_ms: ms(self.latency_us.value_at_quantile(0.99)),
                max_ms: ms(self.latency_us.max()),
            },
            elapsed_s: elapsed.as_secs_f64(),
            violations,
        }
    }
}

/// The whole run: the plan and one report per strategy.
#[derive(Debug, Clone, Serialize)]
pub struct LoadReport {
    /// The shape of the run.
    pub plan: LoadPlan,
    /// Where it ran: "in-process" or the URL.
    pub target: String,
    /// One report per strategy.
    pub strategies: Vec<StrategyReport>,
}

impl LoadReport {
    /// Whether every guarded strategy kept every rule. The unsafe control is expected to
    /// break them and does not count.
    pub fn guarded_strategies_clean(&self) -> bool {
        self.strategies
            .iter()
            .filter(|report| report.strategy != Strategy::Unsafe)
            .all(StrategyReport::is_clean)
    }

    /// The side-by-side table.
    pub fn table(&self) -> String {
        let mut rows: Vec<(String, Vec<String>)> = Vec::new();
        let mut row = |name: &str, cell: &dyn Fn(&StrategyReport) -> String| {
            rows.push((name.to_owned(), self.strategies.iter().map(cell).collect()));
        };
        row("strategy", &|r| r.strategy.to_string());
        row("sold (201)", &|r| r.sold.to_string());
        row("stock left", &|r| r.stock_left.to_string());
        row("oversold", &|r| r.oversold.to_string());
        row("users with >1 order", &|r| {
            r.users_with_several_orders.to_string()
        });
        row("sales Redis counted", &|r| r.sales_recorded.to_string());
        row("orders in SQL", &|r| r.orders_stored.to_string());
        let mut codes: Vec<&String> = self
            .strategies
            .iter()
            .flat_map(|r| r.statuses.keys())
            .collect();
        codes.sort();
        codes.dedup();
        for code in codes {
            row(code, &|r| {
                r.statuses.get(code).copied().unwrap_or(0).to_string()
            });
        }
        row("throughput (req/s)", &|r| {
            format!("{:.0}", r.throughput_rps)
        });
        row("latency p50 (ms)", &|r| format!("{:.2}", r.latency.p50_ms));
        row("latency p99 (ms)", &|r| format!("{:.2}", r.latency.p99_ms));
        row("latency max (ms)", &|r| format!("{:.2}", r.latency.max_ms));
        row("verdict", &|r| verdict(r).to_owned());

        let name_width = rows.iter().map(|(name, _)| name.len()).max().unwrap_or(0);
        let cell_width = rows
            .iter()
            .flat_map(|(_, cells)| cells.iter().map(String::len))
            .max()
            .unwrap_or(0)
            .max(9);
        let mut out = format!(
            "{} requests from {} users at concurrency {} for a coupon of {} units ({})\n\n",
            self.plan.requests,
            self.plan.users,
            self.plan.concurrency,
            self.plan.stock,
            self.target
        );
        for (name, cells) in &rows {
            out.push_str(&format!("{name:<name_width$}"));
            for cell in cells {
                out.push_str(&format!("  {cell:>cell_width$}"));
            }
            out.push('\n');
        }
        for report in &self.strategies {
            for violation in &report.violations {
                out.push_str(&format!("\n{}: {violation}", report.strategy));
            }
        }
        out.push('\n');
        out
    }
}

fn verdict(report: &StrategyReport) -> &'static str {
    match (report.strategy, report.is_clean()) {
        (Strategy::Unsafe, false) => "BROKEN*",
        (Strategy::Unsafe, true) => "lucky*",
        (_, true) => "OK",
        (_, false) => "FAILED",
    }
}

/// `flashsale load`.
pub async fn run(args: LoadArgs) -> CliResult {
    let plan = LoadPlan {
        stock: args.stock,
        requests: args.requests,
        users: args.users,
        concurrency: args.concurrency,
        seed: args.seed,
        drain_timeout: args.drain_timeout,
        progress: !args.json,
    };
    plan.validate().map_err(LoadError::Invalid)?;
    let report = match &args.url {
        Some(url) => run_remote(url, args.strategy, &plan).await?,
        None => run_in_process(&args, &plan).await?,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.table());
        if report
            .strategies
            .iter()
            .any(|r| r.strategy == Strategy::Unsafe)
        {
            println!("* unsafe is the control: GET then DECR with no lock. It is meant to break the rules.");
        }
    }
    Ok(if report.guarded_strategies_clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

async fn run_remote(
    url: &str,
    choice: Option<StrategyChoice>,
    plan: &LoadPlan,
) -> Result<LoadReport, Box<dyn std::error::Error + Send + Sync>> {
    let health = reqwest::get(format!("{}/healthz", url.trim_end_matches('/')))
        .await
        .map_err(|err| format!("cannot reach the service at {url}: {err}"))?
        .text()
        .await?;
    let health: serde_json::Value = serde_json::from_str(&health)
        .map_err(|_| format!("{url}/healthz did not answer JSON; is it a flashsale service?"))?;
    let remote = health
        .get("strategy")
        .and_then(|s| s.as_str())
        .and_then(|name| Strategy::ALL.into_iter().find(|s| s.name() == name))
        .ok_or_else(|| {
            format!("{url}/healthz did not name a strategy; is it a flashsale service?")
        })?;
    if let Some(choice) = choice {
        if choice.strategies() != [remote] {
            return Err(format!(
                "the service at {url} runs --strategy {remote}; a running service has one strategy, so drop --strategy or restart it with the one you want"
            )
            .into());
        }
    }
    let report = run_against(url, remote, plan).await?;
    Ok(LoadReport {
        plan: plan.clone(),
        target: url.to_owned(),
        strategies: vec![report],
    })
}

async fn run_in_process(
    args: &LoadArgs,
    plan: &LoadPlan,
) -> Result<LoadReport, Box<dyn std::error::Error + Send + Sync>> {
    let strategies = args.strategy.unwrap_or(StrategyChoice::All).strategies();
    // One Redis and one database serve every strategy's service in turn.
    let sandbox = Sandbox::new(&args.store, false).await?;
    eprintln!("flashsale load: using {}", sandbox.describe());
    let mut reports = Vec::new();
    for strategy in strategies {
        let config = sandbox.config(strategy, &args.knobs)?;
        let service = Service::start(config).await?;
        let report = run_against(&service.base_url(), strategy, plan).await;
        service.shutdown().await;
        reports.push(report?);
    }
    let target = if sandbox.is_private() {
        "in-process, private redis-server, temporary SQLite".to_owned()
    } else {
        "in-process".to_owned()
    };
    Ok(LoadReport {
        plan: plan.clone(),
        target,
        strategies: reports,
    })
}
