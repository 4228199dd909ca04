//! `flashsale serve | load | bench | reconcile`.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "flashsale",
    version,
    about = "A seckill coupon service on distlock, and the load generator that proves it",
    after_help = flashsale::exit_code::HELP
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the HTTP service until SIGTERM or Ctrl-C.
    Serve(flashsale::serve::ServeArgs),
    /// Create a coupon and hit it with concurrent buyers; check no rule was broken.
    Load(flashsale::load::LoadArgs),
    /// Measure purchases per second with wrk, against a PING endpoint of the same service.
    Bench(flashsale::bench::BenchArgs),
    /// Remove stale segmented claims and report where Redis and SQL disagree (exit 3).
    Reconcile(flashsale::reconcile::ReconcileArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The service logs what it does; the load generator keeps its report readable.
    let default_filter = match cli.command {
        Command::Serve(_) => "warn,flashsale=info",
        Command::Load(_) | Command::Bench(_) | Command::Reconcile(_) => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a person at a terminal, not in a log file or a journal.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(async {
        match cli.command {
            Command::Serve(args) => flashsale::serve::run(args).await,
            Command::Load(args) => flashsale::load::run(args).await,
            Command::Bench(args) => flashsale::bench::run(args).await,
            Command::Reconcile(args) => flashsale::reconcile::run(args).await,
        }
    });
    match outcome {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::from(flashsale::exit_code::of(&*err))
        }
    }
}
