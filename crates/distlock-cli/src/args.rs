//! The command line, as clap reads it. Every value is checked here or by the library,
//! and refused with exit code 2 and one line that says why.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::exit;

/// Run a command under a lock on Redis, the way flock, etcdctl lock and consul lock do,
/// with a fencing token for the command and a stop when the lock is lost.
#[derive(Debug, Parser)]
#[command(name = "distlock", version, after_help = exit::TABLE)]
pub struct Cli {
    #[command(flatten)]
    pub connection: Connection,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Args)]
pub struct Connection {
    /// Redis URL: redis://host:port/db, rediss:// (TLS), redis+sentinel://host:port,…/master,
    /// or redis+cluster://host:port,…. A password belongs in REDIS_URL or --password-file,
    /// never on the command line, where other users can read it.
    #[arg(
        long,
        env = "REDIS_URL",
        hide_env_values = true,
        global = true,
        default_value = "redis://127.0.0.1:6379"
    )]
    pub url: String,
    /// Read the Redis password from this file (its first line).
    #[arg(long, value_name = "FILE", global = true)]
    pub password_file: Option<PathBuf>,
    /// Say on stderr what distlock does: the server, the wait, the lock taken and its
    /// token, the command started and how it ended, signals sent, the release.
    #[arg(short = 'v', long, global = true)]
    pub verbose: bool,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Wait for the lock, run the command, release the lock. The command's exit status is
    /// passed through.
    Run(Run),
    /// Run the command as a leader: while holding the lock. When the lock is lost, stop
    /// the command, take the lock again, and start it again.
    Elect(Elect),
    /// Hold the lock with no command, as `etcdctl lock NAME` does, until SIGTERM, SIGINT
    /// or SIGHUP (then release it and exit 0), or until it is lost (exit 79). Prints
    /// DISTLOCK_NAME=…, DISTLOCK_OWNER=… and DISTLOCK_FENCING_TOKEN=… on stdout once held.
    Hold(HoldOnly),
    /// Show a lock: held or not, holders, remaining lease, last fencing token.
    Status(Status),
    /// Show a lock's fencing counter, or raise it with --at-least (after Redis lost its
    /// data, tokens start again from 1: raise the counter past the highest token your
    /// store accepted). Never lowers it.
    Fence(Fence),
    /// List the locks held now (SCAN, never KEYS).
    List(List),
    /// Delete a lock whoever holds it. Its holder's command is stopped when its
    /// distlock notices (within about a second); asks first unless --yes.
    ForceUnlock(ForceUnlock),
}

/// What `run` and `elect` hold.
#[derive(Debug, Args)]
pub struct Hold {
    /// The lock's name (its Redis key).
    #[arg(value_parser = non_empty_name)]
    pub name: String,
    /// A fixed lease (500ms, 10s, 2m, 1h): the lock is held at most this long, and the
    /// command is stopped before it ends. Without it the lease is renewed while the
    /// command runs (the watchdog).
    #[arg(long, value_parser = lease_duration, value_name = "DURATION")]
    pub lease: Option<Duration>,
    /// The lease the watchdog keeps renewing while the command runs (like etcdctl's
    /// --ttl): a holder that dies, or loses Redis, frees the lock within it. Renewed
    /// every third of it.
    #[arg(long, value_parser = lease_duration, default_value = "30s", value_name = "DURATION", conflicts_with = "lease")]
    pub ttl: Duration,
    /// Queue on the fair lock: holders take turns in the order they asked.
    #[arg(long, conflicts_with = "permits")]
    pub fair: bool,
    /// Hold one of N permits of a semaphore instead of the lock: at most N commands run at
    /// once.
    #[arg(short = 'n', long = "permits", value_name = "N", value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub permits: Option<u32>,
    /// With -n: the number at NAME is a semaphore another program created (Redisson's
    /// RPermitExpirableSemaphore); use it. Without this flag, -n uses only a semaphore
    /// distlock created, never another application's number.
    #[arg(long, requires = "permits")]
    pub adopt_semaphore: bool,
    /// How long the command has to stop after SIGTERM before it gets SIGKILL, when the
    /// lock is lost. Shortened to what the lease allows when the loss is seen coming.
    #[arg(long, value_parser = positive_duration, default_value = "5s", value_name = "DURATION")]
    pub kill_grace: Duration,
}

/// The command `run` and `elect` run: after `--`, or a shell string with -c.
#[derive(Debug, Args)]
pub struct Program {
    /// Run this string with /bin/sh -c instead of a command after `--` (flock's -c,
    /// consul lock's -shell).
    #[arg(
        short = 'c',
        long = "command",
        value_name = "STRING",
        conflicts_with = "command"
    )]
    pub shell: Option<String>,
    /// The command and its arguments, after `--` (any bytes: file names need not be
    /// UTF-8).
    #[arg(last = true, required_unless_present = "shell", num_args = 1.., value_name = "COMMAND", value_parser = clap::builder::OsStringValueParser::new())]
    pub command: Vec<std::ffi::OsString>,
}

impl Program {
    /// The program and its arguments.
    pub fn argv(&self) -> Vec<std::ffi::OsString> {
        match &self.shell {
            Some(shell) => vec!["/bin/sh".into(), "-c".into(), shell.into()],
            None => self.command.clone(),
        }
    }
}

#[derive(Debug, Args)]
pub struct Run {
    #[command(flatten)]
    pub hold: Hold,
    #[command(flatten)]
    pub program: Program,
    #[command(flatten)]
    pub waiting: Waiting,
}

#[derive(Debug, Args)]
pub struct HoldOnly {
    #[command(flatten)]
    pub hold: Hold,
    #[command(flatten)]
    pub waiting: Waiting,
}

/// How long `run` and `hold` wait for the lock.
#[derive(Debug, Args)]
pub struct Waiting {
    /// Do not wait: if the lock is held, exit at once with the conflict code (for cron).
    #[arg(long, conflicts_with = "wait")]
    pub no_wait: bool,
    /// Wait at most this long for the lock, then exit with the conflict code.
    #[arg(long, value_parser = positive_duration, value_name = "DURATION")]
    pub wait: Option<Duration>,
    /// The exit code when the lock is held by someone else.
    #[arg(long, default_value_t = exit::CONFLICT, value_name = "CODE")]
    pub conflict_exit_code: u8,
}

#[derive(Debug, Args)]
pub struct Elect {
    #[command(flatten)]
    pub hold: Hold,
    #[command(flatten)]
    pub program: Program,
}

#[derive(Debug, Args)]
pub struct Status {
    #[arg(value_parser = non_empty_name)]
    pub name: String,
    /// One JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct Fence {
    #[arg(value_parser = non_empty_name)]
    pub name: String,
    /// Raise the counter to at least N: every later holder gets a token above N.
    #[arg(long, value_name = "N")]
    pub at_least: Option<u64>,
    /// One JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct List {
    /// A SCAN MATCH pattern: * any run of characters, ? one character, [..] a set.
    #[arg(default_value = "*")]
    pub pattern: String,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct ForceUnlock {
    #[arg(value_parser = non_empty_name)]
    pub name: String,
    /// Do not ask.
    #[arg(long)]
    pub yes: bool,
}

fn non_empty_name(text: &str) -> Result<String, String> {
    if text.is_empty() {
        return Err("a lock name cannot be empty".into());
    }
    Ok(text.to_owned())
}

/// The shortest lease a command can run under: distlock checks the lock every 500 ms,
/// and needs time to start the command and to stop it before the lease ends.
pub const MIN_LEASE: Duration = Duration::from_secs(1);

/// A lease (`--lease`, `--ttl`): at least [`MIN_LEASE`].
fn lease_duration(text: &str) -> Result<Duration, String> {
    let duration = positive_duration(text)?;
    if duration < MIN_LEASE {
        return Err(format!(
            "{text:?} is too short: a lease must be at least 1s (distlock checks the lock \
             every 500ms, and starts and stops the command within the lease)"
        ));
    }
    Ok(duration)
}

/// A duration flag: distlock's one syntax, and more than zero.
fn positive_duration(text: &str) -> Result<Duration, String> {
    let duration = distlock::parse_duration(text)?;
    if duration.is_zero() {
        return Err(format!("{text:?} is zero; give a positive duration"));
    }
    Ok(duration)
}
