//! An interactive SVG flame graph, drawn by `inferno` (a port of flamegraph.pl) from the
//! [`super::collapsed`] lines, so its frames read exactly as there (functions of all threads
//! merged by default, per [`Options`]). The subtitle says how many idle samples were left
//! out.
//!
//! A profile with no samples is refused ([`OutputError::NoSamples`]) before anything is
//! written: inferno would otherwise draw an "invalid input" picture and fail anyway.
use super::{collapsed, view, Options, OutputError};
use crate::profile::Profile;
use std::io::Write;

pub fn write(profile: &Profile, out: &mut dyn Write, options: &Options) -> Result<(), OutputError> {
    let (shaped, note) = view(profile, options);
    let folded = collapsed::folded(&shaped, options);
    if folded.is_empty() {
        return Err(OutputError::NoSamples);
    }
    let lines: Vec<String> = folded
        .iter()
        .map(|(stack, count)| format!("{stack} {count}"))
        .collect();

    let mut opts = inferno::flamegraph::Options::default();
    let count_name = profile.count_name.as_deref().unwrap_or("samples");
    opts.title = format!(
        "rbspy_ext: pid {}, {} {count_name}",
        profile.pid, shaped.samples
    );
    let mut subtitle = format!(
        "Ruby {}, {:.2} s",
        if profile.ruby_version.is_empty() {
            "?"
        } else {
            &profile.ruby_version
        },
        profile.duration_ns as f64 / 1e9,
    );
    if profile.rate_hz > 0.0 {
        subtitle.push_str(&format!(" at {} Hz", profile.rate_hz));
    }
    if let Some(note) = note {
        subtitle.push_str("; ");
        subtitle.push_str(&note);
    }
    opts.subtitle = Some(subtitle);
    opts.count_name = count_name.to_string();
    // Colour by a hash of the frame name: the same function keeps its colour from one
    // recording to the next.
    opts.hash = true;
    inferno::flamegraph::from_lines(&mut opts, lines.iter().map(String::as_str), out)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::output::{fixture, write, Format, Options};
    use quick_xml::events::Event;

    /// Parses the whole SVG (failing on malformed XML) and returns its text contents (the
    /// frames' `<title>`s and labels among them), entity references resolved.
    fn texts(svg: &str) -> Vec<String> {
        let mut reader = quick_xml::Reader::from_str(svg);
        reader.config_mut().check_end_names = true;
        let mut texts = Vec::new();
        // quick-xml hands a text over in pieces: runs of characters and entity references.
        let mut current = String::new();
        let mut depth = 0i32;
        let mut root = None;
        loop {
            let event = reader.read_event().expect("well-formed XML");
            match &event {
                Event::Text(t) => {
                    current.push_str(&t.decode().expect("UTF-8 text"));
                    continue;
                }
                Event::GeneralRef(r) => {
                    let name = r.decode().expect("UTF-8 reference");
                    current.push_str(match &*name {
                        "amp" => "&",
                        "lt" => "<",
                        "gt" => ">",
                        "quot" => "\"",
                        "apos" => "'",
                        other => panic!("unknown entity {other}"),
                    });
                    continue;
                }
                _ => {}
            }
            if !current.is_empty() {
                texts.push(std::mem::take(&mut current));
            }
            match event {
                Event::Start(e) => {
                    if depth == 0 {
                        root = Some(String::from_utf8(e.name().as_ref().to_vec()).unwrap());
                    }
                    depth += 1;
                }
                Event::End(_) => depth -= 1,
                Event::Eof => break,
                _ => {}
            }
        }
        assert_eq!(depth, 0, "unbalanced elements");
        assert_eq!(root.as_deref(), Some("svg"));
        texts
    }

    #[test]
    fn output_flamegraph_is_well_formed_svg_with_the_frames() {
        let p = fixture::profile();
        let mut out = Vec::new();
        let per_thread = Options {
            per_thread: true,
            lines: true,
            idle: true,
            ..Options::default()
        };
        write(&p, Format::Flamegraph, &mut out, &per_thread).unwrap();
        let svg = String::from_utf8(out).unwrap();
        let all = texts(&svg).join("\n");
        for name in [
            "rbspy_ext: pid 4242, 32 samples",
            "Thread 4242 (main)",
            "Thread 4250 (worker)",
            "<main> app.rb:10",
            "Object#work lib/work.rb:5",
            "Kernel#sleep lib/work.rb:6",
            "Object#fib lib/fib.rb:3",
        ] {
            assert!(all.contains(name), "{name} missing from the SVG's texts");
        }

        let mut out = Vec::new();
        let opts = Options {
            state: true,
            idle: true,
            ..Options::default()
        };
        write(&p, Format::Flamegraph, &mut out, &opts).unwrap();
        let all = texts(&String::from_utf8(out).unwrap()).join("\n");
        assert!(all.contains("[blocked]"));
        assert!(!all.contains("Thread 4242"));

        // The defaults: functions, idle samples left out and said so.
        let mut out = Vec::new();
        write(&p, Format::Flamegraph, &mut out, &Options::default()).unwrap();
        let all = texts(&String::from_utf8(out).unwrap()).join("\n");
        assert!(all.contains("rbspy_ext: pid 4242, 24 samples"), "{all}");
        assert!(
            all.contains("8 idle samples (blocked threads) left out"),
            "{all}"
        );
        assert!(all.contains("Object#work lib/work.rb"));
        assert!(!all.contains("Object#work lib/work.rb:5"));
        assert!(!all.contains("Kernel#sleep"));
    }
}
