//! The command line, as clap reads it. Every value is checked here or by the library,
//! and refused with exit code 2 and one line that says why.

use std::path::PathBuf;
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{ArgMatches, Args, Parser, Subcommand};

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
    /// or redis+cluster://host:port,…. Also read from DISTLOCK_URL, which comes before
    /// REDIS_URL. A password belongs in DISTLOCK_URL, REDIS_URL or --password-file, never
    /// on the command line, where other users can read it.
    #[arg(
        long,
        env = "REDIS_URL",
        hide_env_values = true,
        global = true,
        default_value = "redis://127.0.0.1:6379"
    )]
    pub url: String,
    /// Read the Redis password from this file (its first line).
    #[arg(
        long,
        value_name = "FILE",
        global = true,
        env = "DISTLOCK_PASSWORD_FILE"
    )]
    pub password_file: Option<PathBuf>,
    /// How long connecting (with the first PING) may take (2s).
    #[arg(long, global = true, value_parser = positive_duration, value_name = "DURATION", env = "DISTLOCK_CONNECT_TIMEOUT")]
    pub connect_timeout: Option<Duration>,
    /// How long one command may wait for its reply (1s). Renewals must get through
    /// within a third of --ttl, so keep it well below that.
    #[arg(long, global = true, value_parser = positive_duration, value_name = "DURATION", env = "DISTLOCK_RESPONSE_TIMEOUT")]
    pub response_timeout: Option<Duration>,
    /// TLS (rediss://): trust this CA certificate (PEM) instead of the web's roots.
    #[arg(long, global = true, value_name = "FILE", env = "DISTLOCK_CACERT")]
    pub cacert: Option<PathBuf>,
    /// TLS (rediss://): this client certificate (PEM), for a server with
    /// tls-auth-clients; with --key.
    #[arg(
        long,
        global = true,
        value_name = "FILE",
        env = "DISTLOCK_CERT",
        requires = "key"
    )]
    pub cert: Option<PathBuf>,
    /// TLS (rediss://): the client certificate's private key (PEM); with --cert.
    #[arg(
        long,
        global = true,
        value_name = "FILE",
        env = "DISTLOCK_KEY",
        requires = "cert"
    )]
    pub key: Option<PathBuf>,
    /// Say on stderr what distlock does: the server, the wait, the lock taken and its
    /// token, the command started and how it ended, signals sent, the release.
    #[arg(short = 'v', long, global = true, env = "DISTLOCK_VERBOSE", value_parser = clap::builder::BoolishValueParser::new())]
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
    #[arg(long, value_parser = lease_duration, value_name = "DURATION", env = "DISTLOCK_LEASE")]
    pub lease: Option<Duration>,
    /// The lease the watchdog keeps renewing while the command runs (like etcdctl's
    /// --ttl): a holder that dies, or loses Redis, frees the lock within it. Renewed
    /// every third of it.
    #[arg(long, value_parser = lease_duration, default_value = "30s", value_name = "DURATION", env = "DISTLOCK_TTL")]
    pub ttl: Duration,
    /// Take the read side of a read-write lock: shared holders run beside each other,
    /// never beside an --exclusive one (flock -s).
    #[arg(long, env = "DISTLOCK_SHARED", value_parser = clap::builder::BoolishValueParser::new())]
    pub shared: bool,
    /// Take the write side of a read-write lock: alone, and never beside a --shared
    /// holder (flock -x). Writers are preferred: no new reader while one waits.
    #[arg(long, env = "DISTLOCK_EXCLUSIVE", value_parser = clap::builder::BoolishValueParser::new())]
    pub exclusive: bool,
    /// Queue on the fair lock: holders take turns in the order they asked.
    #[arg(long, env = "DISTLOCK_FAIR", value_parser = clap::builder::BoolishValueParser::new())]
    pub fair: bool,
    /// Hold one of N permits of a semaphore instead of the lock: at most N commands run at
    /// once.
    #[arg(short = 'n', long = "permits", value_name = "N", value_parser = clap::value_parser!(u32).range(1..=10_000), env = "DISTLOCK_PERMITS")]
    pub permits: Option<u32>,
    /// With -n: the number at NAME is a semaphore another program created (Redisson's
    /// RPermitExpirableSemaphore); use it. Without this flag, -n uses only a semaphore
    /// distlock created, never another application's number.
    #[arg(long, env = "DISTLOCK_ADOPT_SEMAPHORE", value_parser = clap::builder::BoolishValueParser::new())]
    pub adopt_semaphore: bool,
    /// How long the command has to stop after SIGTERM before it gets SIGKILL, when the
    /// lock is lost. Shortened to what the lease allows when the loss is seen coming.
    #[arg(long, value_parser = positive_duration, default_value = "5s", value_name = "DURATION", env = "DISTLOCK_KILL_GRACE")]
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
    #[arg(long, env = "DISTLOCK_NO_WAIT", value_parser = clap::builder::BoolishValueParser::new())]
    pub no_wait: bool,
    /// Wait at most this long for the lock, then exit with the conflict code.
    #[arg(long, value_parser = positive_duration, value_name = "DURATION", env = "DISTLOCK_WAIT")]
    pub wait: Option<Duration>,
    /// The exit code when the lock is held by someone else.
    #[arg(long, default_value_t = exit::CONFLICT, value_name = "CODE", env = "DISTLOCK_CONFLICT_EXIT_CODE")]
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
    #[arg(long, env = "DISTLOCK_JSON", value_parser = clap::builder::BoolishValueParser::new())]
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
    #[arg(long, env = "DISTLOCK_JSON", value_parser = clap::builder::BoolishValueParser::new())]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct List {
    /// A SCAN MATCH pattern: * any run of characters, ? one character, [..] a set.
    #[arg(default_value = "*")]
    pub pattern: String,
    /// One JSON object per line instead of a table.
    #[arg(long, env = "DISTLOCK_JSON", value_parser = clap::builder::BoolishValueParser::new())]
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

/// Settles the flags that exclude each other (`--wait` and `--no-wait`, `--lease` and
/// `--ttl`, `--fair` and `-n`, `--adopt-semaphore` without `-n`). Any flag may come from
/// its `DISTLOCK_*` variable: one given on the command line wins over the other's
/// variable, as a command line overrides the environment; two on the command line, or
/// two variables, are a usage error.
pub fn settle(matches: &ArgMatches, cli: &mut Cli) -> Result<(), String> {
    let Some((_, sub)) = matches.subcommand() else {
        return Ok(());
    };
    let (hold, waiting) = match &mut cli.command {
        Command::Run(run) => (&mut run.hold, Some(&mut run.waiting)),
        Command::Hold(held) => (&mut held.hold, Some(&mut held.waiting)),
        Command::Elect(elect) => (&mut elect.hold, None),
        _ => return Ok(()),
    };
    let elect = waiting.is_none();
    // Whether a flag was given, and where: Some(true) on the command line, Some(false)
    // in the environment. A boolean switch set to false counts as not given.
    let given = |id: &str, on: bool| match sub.value_source(id) {
        Some(ValueSource::CommandLine) if on => Some(true),
        Some(ValueSource::EnvVariable) if on => Some(false),
        _ => None,
    };
    if let Some(waiting) = waiting {
        match keep(
            given("no_wait", waiting.no_wait),
            given("wait", waiting.wait.is_some()),
            "--no-wait",
            "--wait",
        )? {
            Keep::First => waiting.wait = None,
            Keep::Second => waiting.no_wait = false,
            Keep::Both => {}
        }
    }
    match keep(
        given("lease", hold.lease.is_some()),
        given("ttl", true),
        "--lease",
        "--ttl",
    )? {
        Keep::First => hold.ttl = DEFAULT_TTL,
        Keep::Second => hold.lease = None,
        Keep::Both => {}
    }
    // One kind of holding: the fair lock, a semaphore's permit, or a side of a
    // read-write lock.
    let kinds = [
        ("fair", "--fair", hold.fair),
        ("permits", "-n", hold.permits.is_some()),
        ("shared", "--shared", hold.shared),
        ("exclusive", "--exclusive", hold.exclusive),
    ];
    let present: Vec<(&str, &str, bool)> = kinds
        .iter()
        .filter_map(|&(id, flag, on)| given(id, on).map(|typed| (id, flag, typed)))
        .collect();
    if present.len() > 1 {
        let typed: Vec<&(&str, &str, bool)> =
            present.iter().filter(|(_, _, typed)| *typed).collect();
        if typed.len() != 1 {
            let flags: Vec<&str> = present.iter().map(|(_, flag, _)| *flag).collect();
            return Err(format!(
                "{} cannot be used together{}",
                flags.join(", "),
                if typed.is_empty() {
                    " (all are set in DISTLOCK_* variables)"
                } else {
                    ""
                }
            ));
        }
        let kept = typed[0].0;
        if kept != "fair" {
            hold.fair = false;
        }
        if kept != "permits" {
            hold.permits = None;
        }
        if kept != "shared" {
            hold.shared = false;
        }
        if kept != "exclusive" {
            hold.exclusive = false;
        }
    }
    // Refused once the kinds are settled: DISTLOCK_SHARED=1 with --exclusive or --fair
    // on the command line is not a shared elect.
    if elect && hold.shared {
        return Err("elect leads alone: --shared would let every candidate lead".into());
    }
    if hold.adopt_semaphore && hold.permits.is_none() {
        match given("adopt_semaphore", true) {
            Some(true) => return Err("--adopt-semaphore needs -n N".into()),
            _ => hold.adopt_semaphore = false,
        }
    }
    Ok(())
}

/// Which of two flags that exclude each other is kept.
enum Keep {
    First,
    Second,
    /// Not both were given.
    Both,
}

fn keep(first: Option<bool>, second: Option<bool>, a: &str, b: &str) -> Result<Keep, String> {
    match (first, second) {
        (Some(true), Some(false)) => Ok(Keep::First),
        (Some(false), Some(true)) => Ok(Keep::Second),
        (Some(true), Some(true)) => Err(format!("{a} cannot be used with {b}")),
        (Some(false), Some(false)) => Err(format!(
            "{a} cannot be used with {b} (both are set in DISTLOCK_* variables)"
        )),
        _ => Ok(Keep::Both),
    }
}

/// `--ttl`'s default.
const DEFAULT_TTL: Duration = Duration::from_secs(30);

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

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::Cli;

    /// Every flag can be set from a DISTLOCK_* variable, as etcdctl reads ETCDCTL_*,
    /// except three that must be typed each time: the command itself (-c), force-unlock's
    /// confirmation (--yes), and fence's raise (--at-least). `--url` reads REDIS_URL
    /// (and DISTLOCK_URL, in main).
    #[test]
    fn every_flag_reads_a_distlock_variable() {
        let exempt = ["help", "version", "shell", "yes", "at_least", "url"];
        let mut command = Cli::command();
        command.build();
        let mut checked = 0;
        let mut commands = vec![command];
        while let Some(command) = commands.pop() {
            for arg in command.get_arguments() {
                let id = arg.get_id().as_str();
                if arg.is_positional() || exempt.contains(&id) {
                    continue;
                }
                let env = arg.get_env().map(|env| env.to_string_lossy().into_owned());
                let wanted = format!("DISTLOCK_{}", id.to_ascii_uppercase());
                assert_eq!(
                    env.as_deref(),
                    Some(wanted.as_str()),
                    "{}: {id}",
                    command.get_name()
                );
                checked += 1;
            }
            commands.extend(command.get_subcommands().cloned());
        }
        assert!(checked > 10, "{checked}");
    }
}
