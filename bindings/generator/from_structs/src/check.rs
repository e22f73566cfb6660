//! `--check`: compares measured layouts with the C-probe layouts in
//! bindings/src/generated.rs, and this program's field list with `struct Layout` in
//! bindings/src/lib.rs. Both files are read as text (see layout.rs for why).

use crate::layout::{Layout, Source};
use std::collections::HashMap;

/// The layouts of generated.rs: `LAYOUTS` entries as (field, value text) lists, and the
/// release -> index map of `VERSIONS`.
pub struct Generated {
    pub layouts: Vec<Vec<(String, String)>>,
    pub versions: HashMap<String, usize>,
}

pub fn parse_generated(text: &str) -> Result<Generated, String> {
    let layouts_at = text.find("LAYOUTS").ok_or("no LAYOUTS in generated.rs")?;
    let versions_at = text
        .find("pub static VERSIONS")
        .ok_or("no VERSIONS in generated.rs")?;
    let mut layouts = Vec::new();
    let mut current: Option<Vec<(String, String)>> = None;
    for line in text[layouts_at..versions_at].lines() {
        let line = line.trim();
        if line.ends_with("Layout {") {
            current = Some(Vec::new());
        } else if line.starts_with('}') {
            layouts.extend(current.take());
        } else if let Some(fields) = current.as_mut() {
            if line.is_empty() || line.starts_with("//") {
                continue;
            }
            let (name, value) = line.split_once(": ").ok_or(format!("bad line: {line}"))?;
            fields.push((name.to_string(), value.trim_end_matches(',').to_string()));
        }
    }
    let mut versions = HashMap::new();
    for line in text[versions_at..].lines() {
        // ("3.1.2", 0),   possibly followed by a comment
        let Some(rest) = line.trim().strip_prefix("(\"") else {
            continue;
        };
        let bad = || format!("bad line: {line}");
        let (release, rest) = rest.split_once('"').ok_or_else(bad)?;
        let (index, _) = rest
            .trim_start_matches(',')
            .split_once(')')
            .ok_or_else(bad)?;
        let index: usize = index.trim().parse().map_err(|_| bad())?;
        versions.insert(release.to_string(), index);
    }
    Ok(Generated { layouts, versions })
}

/// The field names of `pub struct Layout` in lib.rs, in order.
pub fn parse_layout_fields(lib_rs: &str) -> Result<Vec<String>, String> {
    let start = lib_rs
        .find("pub struct Layout {")
        .ok_or("no `pub struct Layout` in lib.rs")?;
    let mut fields = Vec::new();
    for line in lib_rs[start..].lines().skip(1) {
        let line = line.trim();
        if line.starts_with('}') {
            return Ok(fields);
        }
        if let Some(rest) = line.strip_prefix("pub ") {
            if let Some((name, _)) = rest.split_once(':') {
                fields.push(name.trim().to_string());
            }
        }
    }
    Err("unterminated `pub struct Layout`".into())
}

/// Prints how this program's field list differs from `struct Layout`; true if it does not.
pub fn check_field_list(ours: &Layout, theirs: &[String]) -> bool {
    let ours: Vec<&str> = std::iter::once("name")
        .chain(ours.fields.iter().map(|f| f.name))
        .collect();
    let theirs: Vec<&str> = theirs.iter().map(String::as_str).collect();
    if ours == theirs {
        println!(
            "field list: same {} fields, same order as struct Layout in lib.rs",
            ours.len()
        );
        return true;
    }
    for name in theirs.iter().filter(|n| !ours.contains(n)) {
        println!("field list: `{name}` is in struct Layout but not produced here");
    }
    for name in ours.iter().filter(|n| !theirs.contains(n)) {
        println!("field list: `{name}` is produced here but not in struct Layout");
    }
    if ours.iter().all(|n| theirs.contains(n)) && theirs.iter().all(|n| ours.contains(n)) {
        println!("field list: same fields, different order than struct Layout");
    }
    false
}

/// Compares one release field by field with its probe layout and prints every mismatch of a
/// measured or transcribed field. Not-measured fields are listed (with whether they agree)
/// but not counted. Returns the number of mismatches.
pub fn check_release(release: &str, ours: &Layout, generated: &Generated) -> usize {
    let Some(&index) = generated.versions.get(release) else {
        println!("{release}: no C-probe layout in generated.rs, nothing to compare");
        return 0;
    };
    let Some(probe) = generated.layouts.get(index) else {
        println!("{release}: VERSIONS points at LAYOUTS[{index}], which does not exist");
        return 1;
    };
    let probe_value = |name: &str| {
        probe
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    };
    let mut mismatches = 0;
    let mut compared = 0;
    let mut transcribed = 0;
    let mut not_compared = Vec::new();

    // The name: the probe's is the first release of a shared layout, so only the minor
    // series has to agree.
    let probe_name = probe_value("name")
        .unwrap_or("?")
        .trim_matches('"')
        .to_string();
    if probe_name != ours.name {
        println!(
            "{release}: name: here \"{}\", probe \"{probe_name}\"",
            ours.name
        );
        mismatches += 1;
    }
    for field in &ours.fields {
        let here = field.val.to_string();
        let there = probe_value(field.name);
        match (field.source, there) {
            (_, None) => {
                println!(
                    "{release}: {}: here {here}, not in the probe layout",
                    field.name
                );
                mismatches += 1;
            }
            (Source::NotMeasured(_), Some(there)) => {
                let verdict = if here == there { "=" } else { "DIFFERS from" };
                not_compared.push(format!("{} {here} {verdict} {there}", field.name));
            }
            (Source::Measured | Source::Transcribed(_), Some(there)) => {
                compared += 1;
                transcribed += matches!(field.source, Source::Transcribed(_)) as usize;
                if here != there {
                    println!(
                        "{release}: MISMATCH {}: here {here}, probe {there}",
                        field.name
                    );
                    mismatches += 1;
                }
            }
        }
    }
    for (name, value) in probe {
        if name != "name" && ours.get(name).is_none() {
            println!("{release}: {name}: probe {value}, not produced here");
            mismatches += 1;
        }
    }
    println!(
        "{release}: {compared} fields ({transcribed} of them transcribed) compared with \
         LAYOUTS[{index}] (\"{probe_name}\"): {mismatches} mismatch(es)"
    );
    if !not_compared.is_empty() {
        println!(
            "{release}: not measured, so not compared: {}",
            not_compared.join(", ")
        );
    }
    mismatches
}
