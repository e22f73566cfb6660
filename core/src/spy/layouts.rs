//! Which layout a target is read with, and where it came from: the target's own debug
//! information when its Ruby carries it (crate::dwarf), else the table's layout of its
//! release (or of its minor series, for a patch release the table does not know).

use crate::dwarf::{self, DebugLayout};
use crate::error::{Error, Result};
use crate::process::{mapped_file_candidates, Mapping, RubyBinary};
use rbspy_ext_bindings::{layout_for_version, HeapLayout, Layout};
use std::path::Path;

/// Where the layout a spy reads with came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayoutSource {
    /// The target's debug information: the file read, the binary's build-id, and the
    /// table's layout of the same release with the fields where it differs, when the
    /// table has one.
    DebugInfo {
        path: String,
        build_id: Option<String>,
        table: Option<(&'static str, Vec<&'static str>)>,
        cached: bool,
        /// The heap census's layout from the same DWARF (`dwarf::HeapRead`).
        heap: Option<dwarf::HeapRead>,
    },
    /// The table; `unusable` says why the target's debug information was not used, when it
    /// has some.
    Table {
        name: &'static str,
        unusable: Option<(String, String)>,
    },
}

impl LayoutSource {
    /// A profile's note of where its layout came from: for one from debug information, and
    /// for a table used because the debug information was unusable; None for a plain table.
    pub fn note(&self) -> Option<String> {
        match self {
            LayoutSource::Table { unusable: None, .. } => None,
            _ => Some(format!("layout {}", self.lines().join("; "))),
        }
    }

    /// `source: debug info PATH (build-id HEX)` or `source: table NAME`, then, where both
    /// exist, `table NAME agrees` or `table NAME differs: FIELD, ...` (`rubyspy layout`).
    pub fn lines(&self) -> Vec<String> {
        match self {
            LayoutSource::DebugInfo {
                path,
                build_id,
                table,
                heap,
                ..
            } => {
                let id = build_id
                    .as_deref()
                    .map_or_else(String::new, |b| format!(" (build-id {b})"));
                let mut lines = vec![format!("source: debug info {path}{id}")];
                lines.extend(table.iter().map(|(name, differ)| match differ.is_empty() {
                    true => format!("table {name} agrees"),
                    false => format!("table {name} differs: {}", differ.join(", ")),
                }));
                lines.extend(heap.iter().map(|heap| match heap {
                    Ok((_, differ)) if differ.is_empty() => {
                        "heap: debug info; its series' table agrees".to_string()
                    }
                    Ok((_, differ)) => format!(
                        "heap: debug info; its series' table differs: {}",
                        differ.join(", ")
                    ),
                    Err(why) => format!("heap: its series' table ({why})"),
                }));
                lines
            }
            LayoutSource::Table { name, unusable } => {
                let mut lines = vec![format!("source: table {name}")];
                lines.extend(
                    unusable
                        .iter()
                        .map(|(path, why)| format!("debug info not used: {path}: {why}")),
                );
                lines
            }
        }
    }
}

/// A layout to try, with the warning it brings.
pub(super) type Candidate = (&'static Layout, Option<String>);

/// The layouts to try for the target, in order, with the warning each brings, and where
/// the first came from. `force_version` skips the debug information: it asks for a
/// table's layout.
pub(super) fn choose(
    pid: i32,
    maps: &[Mapping],
    binary: &RubyBinary,
    found: &str,
    forced: Option<&str>,
) -> Result<(Vec<Candidate>, LayoutSource)> {
    let table = |version: &str, unusable: Option<(String, String)>| {
        let layouts = resolve_layout(pid, version)?;
        let name = layouts[0].0.name;
        Ok((layouts, LayoutSource::Table { name, unusable }))
    };
    if let Some(version) = forced {
        return table(version, None);
    }
    match debug_layout(pid, maps, binary, found) {
        Ok(None) => table(found, None),
        Ok(Some(d)) => {
            let known = layout_for_version(found);
            let source = LayoutSource::DebugInfo {
                path: d.path.clone(),
                build_id: d.build_id.clone(),
                table: known.map(|t| (t.name, dwarf::differences(d.layout, t))),
                cached: d.cached,
                heap: d.heap.clone(),
            };
            // Should the DWARF's layout not fit (a debug file of another build with no
            // build-id to tell), the table's layouts follow.
            let mut layouts = vec![(d.layout, None)];
            layouts.extend(resolve_layout(pid, found).unwrap_or_default());
            Ok((layouts, source))
        }
        Err(u) => {
            let unusable = (u.path, u.detail);
            match resolve_layout(pid, found) {
                Ok(_) => table(found, Some(unusable)),
                Err(_) => Err(unusable_error(pid, found, &unusable)),
            }
        }
    }
}

/// Where the layout chosen came from: a table layout tried after the DWARF's did not fit
/// is the table's.
pub(super) fn settled(source: LayoutSource, chosen: &'static Layout) -> LayoutSource {
    match source {
        LayoutSource::DebugInfo { path, .. } if chosen.name != dwarf::NAME => LayoutSource::Table {
            name: chosen.name,
            unusable: Some((path, "its layout did not fit".into())),
        },
        source => source,
    }
}

/// Where no layout fitted: debug information that was there but unusable is what to fix,
/// not the table.
pub(super) fn refusal(source: &LayoutSource, pid: i32, found: &str) -> Option<Error> {
    match source {
        LayoutSource::Table {
            unusable: Some(u), ..
        } => Some(unusable_error(pid, found, u)),
        _ => None,
    }
}

/// The heap census's layout from the target's debug information, when it gave one.
pub(super) fn debug_heap(source: &LayoutSource) -> Option<&'static HeapLayout> {
    match source {
        LayoutSource::DebugInfo {
            heap: Some(Ok((h, _))),
            ..
        } => Some(h),
        _ => None,
    }
}

/// The error for debug information that could not be used, where no table fits either.
pub(super) fn unusable_error(pid: i32, found: &str, (path, detail): &(String, String)) -> Error {
    Error::DebugInfo {
        pid,
        version: found.to_string(),
        path: path.clone(),
        detail: detail.clone(),
    }
}

/// The layout the binary's own debug information (or its separate debug file) gives.
fn debug_layout(
    pid: i32,
    maps: &[Mapping],
    binary: &RubyBinary,
    found: &str,
) -> std::result::Result<Option<DebugLayout>, dwarf::Unusable> {
    let Some(mapping) = maps
        .iter()
        .filter(|m| m.path == binary.path)
        .min_by_key(|m| m.start)
    else {
        return Ok(None);
    };
    let root = format!("/proc/{pid}/root");
    for file in mapped_file_candidates(pid, mapping) {
        if std::fs::File::open(&file).is_ok() {
            return dwarf::layout_for(Path::new(&file), &binary.path, Path::new(&root), found);
        }
    }
    Ok(None)
}

/// The layouts to try for a version string: its own, or for an unknown patch release of a
/// known minor series each distinct layout of that series, newest first (with a warning
/// naming the release whose layout it is).
pub(super) fn resolve_layout(
    pid: i32,
    version: &str,
) -> Result<Vec<(&'static Layout, Option<String>)>> {
    let not_a_version = || Error::UnsupportedVersion {
        pid,
        version: version.to_string(),
        detail: "not a MAJOR.MINOR.PATCH version".into(),
    };
    let parts: Vec<u32> = version
        .split('.')
        .map(|p| p.parse::<u32>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| not_a_version())?;
    if parts.len() != 3 {
        return Err(not_a_version());
    }
    // Every layout the table has for the release itself, in its order: a release and the
    // dev builds before it share a version string (4.1.0), and the first that fits wins.
    let own: Vec<Candidate> = (rbspy_ext_bindings::VERSIONS.iter())
        .filter(|(v, _)| *v == version)
        .map(|(_, i)| (&rbspy_ext_bindings::LAYOUTS[*i], None))
        .collect();
    if !own.is_empty() {
        return Ok(own);
    }
    let series = layouts_of_minor(parts[0], parts[1]);
    if series.is_empty() {
        let (oldest, newest) = rbspy_ext_bindings::supported_range();
        return Err(Error::UnsupportedVersion {
            pid,
            version: version.to_string(),
            detail: format!(
                "supported: Ruby {oldest} to {newest}, and newer patch releases of those minor \
                 series"
            ),
        });
    }
    Ok(series
        .into_iter()
        .map(|(known, layout)| {
            let warning = format!(
                "Ruby {version} is newer than the layout table; using the layout of {known}"
            );
            (layout, Some(warning))
        })
        .collect())
}

/// Each distinct layout of the releases `major.minor.*` in the table, with the newest
/// release that has it, newest first.
fn layouts_of_minor(major: u32, minor: u32) -> Vec<(&'static str, &'static Layout)> {
    let prefix = format!("{major}.{minor}.");
    let mut releases: Vec<(u32, &'static str, usize)> = rbspy_ext_bindings::VERSIONS
        .iter()
        .filter_map(|(v, index)| Some((v.strip_prefix(&prefix)?.parse().ok()?, *v, *index)))
        .collect();
    releases.sort_unstable_by_key(|r| std::cmp::Reverse(r.0));
    let mut out: Vec<(&'static str, &'static Layout)> = Vec::new();
    let mut seen = Vec::new();
    for (_, v, index) in releases {
        if !seen.contains(&index) {
            seen.push(index);
            out.push((v, &rbspy_ext_bindings::LAYOUTS[index]));
        }
    }
    out
}
