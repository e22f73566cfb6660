//! The raw format: the whole [`Profile`], to be read back by [`read_raw`] and written again in
//! any format later. Uncompressed UTF-8 text, two lines:
//!
//! ```text
//! {"format":"rbspy_ext raw profile","version":1,"pid":4242,"ruby_version":"3.3.0","samples":32}
//! {"pid":4242,"ruby_version":"3.3.0",...,"frames":[...],"stacks":[...]}
//! ```
//!
//! The first line identifies the file and its [`RAW_FORMAT_VERSION`] (`head -1` tells what a
//! file is; the other header fields are informative only); the second is the profile as
//! serde JSON. Frames are already interned; the timeline (two numbers a sample, at most
//! `timeline::MAX_SAMPLES`) is what grows with the recording's length. They are not compressed so
//! that they can be inspected, but [`read_raw`] also reads a gzipped one (`gzip file.raw.json`).
//!
//! `read_raw(write(p)) == p`. Reading never panics: a file that is not ours, of another
//! version, cut short, or inconsistent (an index out of range) is an error.
use super::{check, OutputError};
use crate::profile::{Profile, RAW_FORMAT_VERSION};
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};

/// The `format` field of the header line.
pub const RAW_FORMAT_NAME: &str = "rbspy_ext raw profile";

#[derive(Serialize)]
struct Header<'a> {
    format: &'static str,
    version: u32,
    pid: i32,
    ruby_version: &'a str,
    samples: u64,
}

/// What `read_raw` needs of the header (the rest may change freely).
#[derive(Deserialize)]
struct ReadHeader {
    format: String,
    version: u64,
}

pub fn write(profile: &Profile, out: &mut dyn Write) -> Result<(), OutputError> {
    // JSON has no NaN or infinity (serde_json would write null, which would not read back).
    if !profile.rate_hz.is_finite() {
        return Err(OutputError::InvalidProfile(format!(
            "the sampling rate is {}",
            profile.rate_hz
        )));
    }
    let header = Header {
        format: RAW_FORMAT_NAME,
        version: RAW_FORMAT_VERSION,
        pid: profile.pid,
        ruby_version: &profile.ruby_version,
        samples: profile.samples,
    };
    serde_json::to_writer(&mut *out, &header)?;
    out.write_all(b"\n")?;
    serde_json::to_writer(&mut *out, profile)?;
    out.write_all(b"\n")?;
    Ok(())
}

/// Reads a profile written in the raw format (plain or gzipped).
pub fn read_raw(input: &mut dyn Read) -> Result<Profile, OutputError> {
    let mut bytes = Vec::new();
    input.read_to_end(&mut bytes)?;
    if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut plain = Vec::new();
        flate2::read::MultiGzDecoder::new(&bytes[..])
            .read_to_end(&mut plain)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::UnexpectedEof => {
                    OutputError::Truncated(format!("gzip stream: {e}"))
                }
                _ => OutputError::Corrupt(format!("gzip stream: {e}")),
            })?;
        bytes = plain;
    }
    if bytes.is_empty() {
        return Err(OutputError::Truncated("the file is empty".into()));
    }

    let Some(newline) = bytes.iter().position(|&b| b == b'\n') else {
        // One line and no newline: a header cut short, or not our file at all.
        return Err(match serde_json::from_slice::<ReadHeader>(&bytes) {
            Ok(_) => OutputError::Truncated("the profile after the header is missing".into()),
            Err(e) if e.is_eof() && bytes.starts_with(b"{\"format\"") => {
                OutputError::Truncated("the header line is cut short".into())
            }
            Err(_) => OutputError::NotRaw("no header line".into()),
        });
    };
    let header: ReadHeader = serde_json::from_slice(&bytes[..newline])
        .map_err(|e| OutputError::NotRaw(format!("the first line is not its header ({e})")))?;
    if header.format != RAW_FORMAT_NAME {
        return Err(OutputError::NotRaw(format!(
            "its format is {:?}, not {RAW_FORMAT_NAME:?}",
            header.format
        )));
    }
    if header.version != u64::from(RAW_FORMAT_VERSION) {
        return Err(OutputError::UnsupportedVersion {
            found: header.version,
            supported: RAW_FORMAT_VERSION,
        });
    }

    let body = &bytes[newline + 1..];
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(OutputError::Truncated(
            "the profile after the header is missing".into(),
        ));
    }
    let profile: Profile = serde_json::from_slice(body).map_err(|e| {
        if e.is_eof() {
            OutputError::Truncated(format!("the profile ends early ({e})"))
        } else {
            OutputError::Corrupt(e.to_string())
        }
    })?;
    check(&profile).map_err(OutputError::Corrupt)?;
    Ok(profile)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::{fixture, write as write_format, Format, Options};
    use std::sync::Arc;

    fn raw(p: &Profile) -> Vec<u8> {
        let mut out = Vec::new();
        write_format(p, Format::Raw, &mut out, &Options::default()).unwrap();
        out
    }

    #[test]
    fn output_raw_round_trips() {
        let mut p = fixture::profile();
        // Everything a profile can hold: an absolute path, an odd rate, unicode, big counts.
        p.frames[0].absolute_path = Some(Arc::from("/srv/app/app.rb"));
        p.rate_hz = 99.7;
        p.threads[1].name = Some("wörker \"quoted\"\n".into());
        p.start_unix_ns = u64::MAX;
        p.stacks[0].count = u64::MAX / 4;
        let bytes = raw(&p);
        let text = std::str::from_utf8(&bytes).unwrap();
        let first = text.lines().next().unwrap();
        assert!(
            first.starts_with(r#"{"format":"rbspy_ext raw profile","version":1,"#),
            "{first}"
        );
        assert_eq!(text.lines().count(), 2);
        let again = read_raw(&mut &bytes[..]).unwrap();
        assert_eq!(again, p);
        // Written again, byte for byte the same.
        assert_eq!(raw(&again), bytes);
        // And the empty profile.
        let empty = crate::profile::Aggregator::new(1, "", 0.0, 0).finish(0);
        assert_eq!(read_raw(&mut &raw(&empty)[..]).unwrap(), empty);
        // A rate JSON cannot hold is refused rather than written unreadable.
        let mut nan = empty;
        nan.rate_hz = f64::NAN;
        let err = write_format(&nan, Format::Raw, &mut Vec::new(), &Options::default());
        assert!(
            matches!(err, Err(OutputError::InvalidProfile(_))),
            "{err:?}"
        );
    }

    #[test]
    fn output_raw_reads_gzipped() {
        let p = fixture::profile();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&raw(&p)).unwrap();
        let bytes = gz.finish().unwrap();
        assert_eq!(read_raw(&mut &bytes[..]).unwrap(), p);
        // A gzip stream cut short.
        let err = read_raw(&mut &bytes[..bytes.len() / 2]).unwrap_err();
        assert!(matches!(err, OutputError::Truncated(_)), "{err}");
    }

    #[test]
    fn output_raw_truncated_at_every_length_is_an_error() {
        let bytes = raw(&fixture::profile());
        for len in 0..bytes.len() - 1 {
            match read_raw(&mut &bytes[..len]) {
                Ok(_) => panic!("read a profile cut at {len} of {} bytes", bytes.len()),
                Err(OutputError::Truncated(_)) => {}
                // Cut inside a number or a keyword ("tru"), JSON reports a syntax error.
                Err(OutputError::Corrupt(_)) | Err(OutputError::NotRaw(_)) => {}
                Err(e) => panic!("cut at {len}: unexpected {e}"),
            }
        }
        // Cut right after the header, and in the middle of the profile.
        let newline = bytes.iter().position(|&b| b == b'\n').unwrap();
        for len in [newline, newline + 1, newline + 100] {
            let err = read_raw(&mut &bytes[..len]).unwrap_err();
            assert!(matches!(err, OutputError::Truncated(_)), "{len}: {err}");
        }
        // Without the final newline it is still whole.
        assert!(read_raw(&mut &bytes[..bytes.len() - 1]).is_ok());
    }

    #[test]
    fn output_raw_rejects_other_files_versions_and_corruption() {
        let bytes = raw(&fixture::profile());
        let text = String::from_utf8(bytes).unwrap();
        let read = |s: &str| read_raw(&mut s.as_bytes());

        let err = read(&text.replacen("\"version\":1", "\"version\":2", 1)).unwrap_err();
        assert!(
            matches!(
                err,
                OutputError::UnsupportedVersion {
                    found: 2,
                    supported: 1
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("version 2"));

        let err = read(&text.replacen("rbspy_ext raw profile", "something else", 1)).unwrap_err();
        assert!(matches!(err, OutputError::NotRaw(_)), "{err}");
        for other in [
            "hello\nworld\n",
            "<svg>\n</svg>",
            "\u{0}\u{1}\u{2}\n",
            "{}\n{}\n",
            "[1]\n",
        ] {
            let err = read(other).unwrap_err();
            assert!(matches!(err, OutputError::NotRaw(_)), "{other:?}: {err}");
        }
        // Collapsed or speedscope output is not raw.
        let mut collapsed = Vec::new();
        write_format(
            &fixture::profile(),
            Format::Collapsed,
            &mut collapsed,
            &Options::default(),
        )
        .unwrap();
        assert!(matches!(
            read_raw(&mut &collapsed[..]),
            Err(OutputError::NotRaw(_))
        ));

        // A body that is not a profile, or an inconsistent one.
        let (header, body) = text.split_once('\n').unwrap();
        for body in [
            "[]".to_string(),
            "{\"pid\":1}".to_string(),
            body.replacen("\"pid\":4242", "\"pid\":\"x\"", 1),
            body.replacen("\"state\":\"running\"", "\"state\":\"dancing\"", 1),
            body.replacen("\"thread\":1", "\"thread\":9", 1),
            body.replacen("\"frames\":[0,1]", "\"frames\":[0,1000]", 1),
            body.replacen("\"count\":10", "\"count\":18446744073709551615", 1),
            format!("{body} trailing"),
        ] {
            assert_ne!(
                &body,
                text.split_once('\n').unwrap().1,
                "the test's edit applies"
            );
            let err = read(&format!("{header}\n{body}")).unwrap_err();
            assert!(matches!(err, OutputError::Corrupt(_)), "{body:.80}: {err}");
        }
        // Bytes flipped anywhere: an error or (in a string) another valid profile, no panic.
        let bytes = text.as_bytes();
        for i in (0..bytes.len()).step_by(7) {
            let mut b = bytes.to_vec();
            b[i] ^= 0x55;
            let _ = read_raw(&mut &b[..]);
        }
    }
}
