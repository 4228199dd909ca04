//! A private certificate authority for TLS tests: a CA and one certificate for 127.0.0.1
//! it signed, usable as a server's and as a client's, made with the openssl command.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::TestkitError;

/// The files [`write_test_certificates`] made.
#[derive(Debug, Clone)]
pub struct TestCertificates {
    /// The CA's certificate (PEM): what a client or a server trusts.
    pub ca: PathBuf,
    /// A certificate for 127.0.0.1 the CA signed (PEM).
    pub cert: PathBuf,
    /// That certificate's private key (PEM, unencrypted).
    pub key: PathBuf,
}

/// Writes `ca.crt`, `ca.key`, `server.crt` and `server.key` into `dir`. The certificates
/// are valid for one day.
pub fn write_test_certificates(dir: &Path) -> Result<TestCertificates, TestkitError> {
    let openssl = |args: &[&str]| -> Result<(), TestkitError> {
        let status = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map_err(|source| TestkitError::Io {
                context: "running openssl (./dev test installs it)".into(),
                source,
            })?;
        if status.success() {
            Ok(())
        } else {
            Err(TestkitError::Io {
                context: format!("openssl {args:?}"),
                source: std::io::Error::other(format!("exited with {status}")),
            })
        }
    };
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=distlock test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
    ])?;
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    ])?;
    std::fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").map_err(|source| {
        TestkitError::Io {
            context: "writing san.ext".into(),
            source,
        }
    })?;
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        "san.ext",
        "-out",
        "server.crt",
    ])?;
    Ok(TestCertificates {
        ca: dir.join("ca.crt"),
        cert: dir.join("server.crt"),
        key: dir.join("server.key"),
    })
}
