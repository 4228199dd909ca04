//! Where the password comes from, and the connection. The password is never taken from
//! the command line (other users read it in `ps`), and never printed: errors name the
//! server without it.

use std::path::Path;

use clap::parser::ValueSource;

use crate::args::Connection;
use crate::exit::{self, Failure};

/// Connects to the Redis the arguments name. `ttl`: the lease the watchdog renews (`run`
/// and `elect`); the library's default otherwise. `allow_eviction`: connect to a server
/// that may evict keys (to look at locks, never to take one).
pub async fn connect(
    connection: &Connection,
    url_source: Option<ValueSource>,
    ttl: Option<std::time::Duration>,
    allow_eviction: bool,
) -> Result<distlock::Client, Failure> {
    if url_source == Some(ValueSource::CommandLine) && carries_password(&connection.url) {
        return Err(Failure::new(
            exit::USAGE,
            "--url carries a password, which other users of this machine can read on the \
             command line; put the URL in REDIS_URL, or the password in --password-file",
        ));
    }
    let url = match &connection.password_file {
        None => connection.url.clone(),
        Some(file) => with_password(&connection.url, &read_password(file)?)?,
    };
    let mut builder = distlock::Client::builder().allow_eviction(allow_eviction);
    if let Some(timeout) = connection.connect_timeout {
        builder = builder.connection_timeout(timeout);
    }
    if let Some(timeout) = connection.response_timeout {
        builder = builder.response_timeout(timeout);
    }
    if let Some(certificates) = certificates(connection)? {
        builder = builder.tls_certificates(certificates);
    }
    if let Some(ttl) = ttl {
        builder = builder.watchdog_timeout(ttl);
    }
    crate::out::verbose(|| format!("connecting to {}", masked(&url)));
    let connected = builder.connect(&url).await;
    if let Ok(client) = &connected {
        // One server, not a deployment that follows a failover (src/exit.rs: READONLY).
        let scheme = url.split_once("://").map_or("", |(scheme, _)| scheme);
        exit::set_single_server(
            client.store() == distlock::StoreKind::Redis
                && !scheme.contains('+')
                && !client.is_cluster(),
        );
        crate::out::verbose(|| {
            format!(
                "connected{}",
                match client.store() {
                    distlock::StoreKind::Postgres => " to PostgreSQL",
                    distlock::StoreKind::Zk => " to ZooKeeper",
                    _ if client.is_cluster() => " to a Redis Cluster",
                    _ => "",
                }
            )
        });
    }
    connected.map_err(|err| match err {
        // A URL that does not parse is not quoted: where its password ends is unknown.
        distlock::Error::InvalidUrl { reason, .. } => Failure::new(
            exit::USAGE,
            format!("the URL is not valid ({reason}); a password in a URL must be percent-encoded, or given in --password-file"),
        ),
        err => redact(Failure::from(err), &url),
    })
}

/// The TLS certificates `--cacert`, `--cert` and `--key` name, if any.
fn certificates(connection: &Connection) -> Result<Option<redis::TlsCertificates>, Failure> {
    let read = |flag: &str, file: &Path| {
        std::fs::read(file).map_err(|err| {
            Failure::new(
                exit::USAGE,
                format!("cannot read {flag} {}: {err}", file.display()),
            )
        })
    };
    let root_cert = match &connection.cacert {
        Some(file) => Some(read("--cacert", file)?),
        None => None,
    };
    let client_tls = match (&connection.cert, &connection.key) {
        (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
            client_cert: read("--cert", cert)?,
            client_key: read("--key", key)?,
        }),
        _ => None,
    };
    if root_cert.is_none() && client_tls.is_none() {
        return Ok(None);
    }
    if !connection.url.starts_with("rediss") {
        return Err(Failure::new(
            exit::USAGE,
            "--cacert, --cert and --key are for TLS to Redis: give a rediss:// URL \
             (rediss+cluster://, rediss+sentinel://); for PostgreSQL, put sslmode, \
             sslrootcert, sslcert and sslkey in the postgres:// URL",
        ));
    }
    Ok(Some(redis::TlsCertificates {
        client_tls,
        root_cert,
    }))
}

/// The first line of `file`, without its line ending.
fn read_password(file: &Path) -> Result<String, Failure> {
    let text = std::fs::read_to_string(file).map_err(|err| {
        Failure::new(
            exit::USAGE,
            format!("cannot read --password-file {}: {err}", file.display()),
        )
    })?;
    let password = text.lines().next().unwrap_or("").to_owned();
    if password.is_empty() {
        return Err(Failure::new(
            exit::USAGE,
            format!("--password-file {} is empty", file.display()),
        ));
    }
    Ok(password)
}

/// The URL's authority (`user:password@host:port,…`) and where it sits in the URL. A
/// password may hold `/`, `?` or `#` unencoded, so the user info runs to the last `@`
/// before the hosts, and only then does the authority end at a `/` or `?`.
fn authority(url: &str) -> Option<(usize, &str)> {
    let start = url.find("://")? + 3;
    let rest = &url[start..];
    let hosts_from = rest.rfind('@').map_or(0, |at| at + 1);
    let end = rest[hosts_from..]
        .find(['/', '?'])
        .map_or(rest.len(), |end| hosts_from + end);
    Some((start, &rest[..end]))
}

/// The password part of a URL's user info, if it has one.
fn password_of(url: &str) -> Option<&str> {
    let (_, authority) = authority(url)?;
    let (userinfo, _) = authority.rsplit_once('@')?;
    let (_, password) = userinfo.split_once(':')?;
    (!password.is_empty()).then_some(password)
}

/// Whether the URL carries a password anywhere: its user info, or a query parameter
/// (`sentinel_password=`).
fn carries_password(url: &str) -> bool {
    password_of(url).is_some()
        || url.split_once('?').is_some_and(|(_, query)| {
            query
                .split('&')
                .any(|pair| pair.to_ascii_lowercase().contains("password="))
        })
}

/// `url` with `password` in its user info (percent-encoded), keeping a user it names.
fn with_password(url: &str, password: &str) -> Result<String, Failure> {
    if password_of(url).is_some() {
        return Err(Failure::new(
            exit::USAGE,
            "the URL already carries a password; give it there or in --password-file, not both",
        ));
    }
    let Some((start, authority)) = authority(url) else {
        return Err(Failure::new(
            exit::USAGE,
            "the Redis URL has no scheme (redis://…)",
        ));
    };
    let (user, hosts) = match authority.rsplit_once('@') {
        Some((userinfo, hosts)) => (userinfo.trim_end_matches(':'), hosts),
        None => ("", authority),
    };
    let encoded: String = password
        .bytes()
        .map(|byte| match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (byte as char).to_string()
            }
            _ => format!("%{byte:02X}"),
        })
        .collect();
    Ok(format!(
        "{}{user}:{encoded}@{hosts}{}",
        &url[..start],
        &url[start + authority.len()..]
    ))
}

/// The values of the URL's query parameters whose name holds `password`
/// (`sentinel_password=`, and any other the library may read as one).
fn query_passwords(url: &str) -> Vec<&str> {
    let Some((start, authority)) = authority(url) else {
        return Vec::new();
    };
    let rest = &url[start + authority.len()..];
    let Some((_, query)) = rest.split_once('?') else {
        return Vec::new();
    };
    let query = query.split('#').next().unwrap_or("");
    query
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .filter(|(key, value)| key.to_ascii_lowercase().contains("password") && !value.is_empty())
        .map(|(_, value)| value)
        .collect()
}

/// `url` with every password in it masked (its user info's, and every password-like
/// query parameter's), to be shown.
fn masked(url: &str) -> String {
    let mut shown = match password_of(url) {
        Some(password) => url.replacen(&format!(":{password}@"), ":***@", 1),
        None => url.to_owned(),
    };
    for password in query_passwords(url) {
        shown = mask_parameters(&shown, password);
    }
    shown
}

/// `text` with `password` masked where it is a parameter's value (`=password` followed
/// by `&`, `#`, a blank, a quote or the end).
fn mask_parameters(text: &str, password: &str) -> String {
    let needle = format!("={password}");
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(&needle) {
        let end = at + needle.len();
        let whole = rest[end..].chars().next().is_none_or(|next| {
            matches!(next, '&' | '#' | '"' | '\'' | ')') || next.is_whitespace()
        });
        out.push_str(&rest[..at]);
        out.push_str(if whole { "=***" } else { &needle });
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// A failure whose message may quote the URL: the URL is quoted with its passwords
/// masked. (Masking every occurrence of the password instead would show where a short
/// one's letters are in the rest of the message.)
fn redact(mut failure: Failure, url: &str) -> Failure {
    failure.message = failure.message.replace(url, &masked(url));
    if let Some(password) = password_of(url) {
        // The library may quote the user info alone (`user:password@host`).
        failure.message = failure.message.replace(&format!(":{password}@"), ":***@");
    }
    for password in query_passwords(url) {
        failure.message = mask_parameters(&failure.message, password);
    }
    failure
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_password_is_put_into_the_urls_user_info_encoded() {
        assert_eq!(
            with_password("redis://127.0.0.1:6379/0", "p@ss:w/rd").unwrap(),
            "redis://:p%40ss%3Aw%2Frd@127.0.0.1:6379/0"
        );
        assert_eq!(
            with_password("rediss://app@h:1", "x").unwrap(),
            "rediss://app:x@h:1"
        );
        assert_eq!(
            with_password("redis+sentinel://a:1,b:2/main", "x").unwrap(),
            "redis+sentinel://:x@a:1,b:2/main"
        );
        assert!(with_password("redis://u:old@h:1", "new").is_err());
        assert!(with_password("127.0.0.1:6379", "x").is_err());
    }

    #[test]
    fn a_password_is_found_and_masked() {
        assert_eq!(password_of("redis://u:secret@h:1/0"), Some("secret"));
        assert_eq!(password_of("redis://:secret@h:1"), Some("secret"));
        assert_eq!(password_of("redis://u@h:1"), None);
        let failure = redact(
            Failure::new(69, "cannot reach u:secret@h"),
            "redis://u:secret@h:1",
        );
        assert_eq!(failure.message, "cannot reach u:***@h");
    }

    #[test]
    fn every_password_like_query_parameter_is_masked() {
        let url = "redis+sentinel://:pw@h:1/main?sentinel_password=hunter2&db=0";
        assert_eq!(
            masked(url),
            "redis+sentinel://:***@h:1/main?sentinel_password=***&db=0"
        );
        assert_eq!(
            masked("redis+sentinel://h:1/m?sentinel_password=hunter2"),
            "redis+sentinel://h:1/m?sentinel_password=***"
        );
        let failure = redact(
            Failure::new(69, "cannot reach sentinel (sentinel_password=hunter2)"),
            "redis+sentinel://h:1/m?sentinel_password=hunter2",
        );
        assert!(!failure.message.contains("hunter2"), "{}", failure.message);
    }
}
