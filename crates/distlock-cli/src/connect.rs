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
        crate::out::verbose(|| {
            format!(
                "connected{}",
                if client.is_cluster() {
                    " to a Redis Cluster"
                } else {
                    ""
                }
            )
        });
    }
    connected.map_err(|err| match err {
        // A URL that does not parse is not quoted: where its password ends is unknown.
        distlock::Error::InvalidUrl { reason, .. } => Failure::new(
            exit::USAGE,
            format!("the Redis URL is not valid ({reason}); a password in a URL must be percent-encoded, or given in --password-file"),
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
            "--cacert, --cert and --key are for TLS: give a rediss:// URL \
             (rediss+cluster://, rediss+sentinel://)",
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

/// `url` with its password masked, to be shown.
fn masked(url: &str) -> String {
    match password_of(url) {
        Some(password) => url.replacen(&format!(":{password}@"), ":***@", 1),
        None => url.to_owned(),
    }
}

/// A failure whose message may quote the URL: the URL is quoted with its password
/// masked. (Masking every occurrence of the password instead would show where a short
/// one's letters are in the rest of the message.)
fn redact(mut failure: Failure, url: &str) -> Failure {
    if let Some(password) = password_of(url) {
        let masked = url.replacen(&format!(":{password}@"), ":***@", 1);
        failure.message = failure.message.replace(url, &masked);
        // The library may quote the user info alone (`user:password@host`).
        failure.message = failure.message.replace(&format!(":{password}@"), ":***@");
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
}
