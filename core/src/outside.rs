//! Every reader of bytes that come from outside the profiler, as one function each that takes
//! any bytes and must neither panic, hang nor allocate without bound: the files a user hands
//! back (raw profiles, saved censuses), what a client sends the listener, what a target
//! publishes (its allocations blob, OpenTelemetry's thread and process context) and the ELF files and maps text of a target.
//!
//! The fuzz targets in `fuzz/` are one line each over these, and `tests/outside_inputs.rs`
//! replays every input a fuzz run found a crash with (`tests/outside_inputs/<target>/`), so
//! that each stays fixed. Memory images of live Rubies (`image`) drive the rest:
//! `memory_image` the stack walker and the tag tables, `heap_image` the census (the
//! mutation fuzzing of `tests/synthetic.rs` covers the same readers over synthetic images).
use crate::allocs::published::LiveSet;
use crate::census::{render, Census};
use crate::output::{self, Format, Options};
use crate::process;
use std::io::Write;

/// A writer that keeps nothing: rendering is exercised, its output is not wanted.
struct Sink;

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A profile in the raw format (`Profile.load`, `rubyspy report`), plain or gzipped, then
/// written in every format: a file that loads must render.
pub fn raw_profile(data: &[u8]) {
    let Ok(profile) = output::raw::read_raw(&mut &data[..]) else {
        return;
    };
    for format in Format::ALL {
        let _ = output::write(&profile, format, &mut Sink, &Options::default());
    }
}

/// A census saved as JSON (`Census.load`, `rubyspy heap --diff`), then rendered and diffed
/// with itself and with nothing, as `--diff` does with two.
pub fn census_file(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(census) = Census::from_json(text) else {
        return;
    };
    let _ = render::text(&census, 100);
    let _ = render::pprof(&census);
    let _ = render::diff_text(&census.diff(&census), 100);
    let _ = render::diff_text(&census.diff(&Census::default()), 100);
    let _ = (census.counts(), census.objects());
}

/// A request head as the listener reads it off a connection: parsed, routed, its query
/// decoded.
pub fn http_request(data: &[u8]) {
    let _ = crate::serve::screen(data);
}

/// An ELF file as the spy reads a target's binary and extension: header, program headers,
/// both symbol tables and their string tables.
pub fn elf(data: &[u8]) {
    const WANTED: &[&str] = &["ruby_version", "ruby_current_vm_ptr", "ruby_global_symbols"];
    let _ = process::parse_binary(data, "fuzzed", 0x5555_0000_0000, WANTED);
}

/// An ELF file's debug information, read as a target's layout (core/src/dwarf/): any bytes
/// give a layout or an error, within bounded time and memory.
pub fn debug_info(data: &[u8]) {
    let _ = crate::dwarf::layout_from_bytes(data, "3.4.5");
}

/// /proc/PID/maps text, and the heap ranges the census takes from it.
pub fn maps(data: &[u8]) {
    let maps = process::parse_maps(&String::from_utf8_lossy(data));
    let _ = process::heap_ranges(&maps);
}

/// The live set a tracking target publishes (`rbspy_ext_allocations_state`), decoded and
/// encoded again.
pub fn live_set(data: &[u8]) {
    if let Ok(set) = LiveSet::decode(data) {
        let _ = set.encode();
    }
}

/// OpenTelemetry's thread context record (`otel_thread_ctx_v1`'s, OTEP 4947) as a target
/// publishes it: decoded, named through a key map, encoded again. The first byte says how
/// many names the key map has.
pub fn otel_thread_record(data: &[u8]) {
    use crate::context::otel_thread::{Head, Record};
    let Some((&keys, raw)) = data.split_first() else {
        return;
    };
    let key_map: Vec<String> = (0..keys).map(|k| format!("key {k}")).collect();
    let _ = Head::parse(raw).map(|h| h.has_trace());
    if let Ok((record, _)) = Record::decode(raw) {
        let _ = record.named(&key_map);
        let (again, left_out) = record.encode();
        assert!(again.len() <= crate::context::otel_thread::MAX_RECORD_LEN);
        assert_eq!(left_out, 0, "a record read whole fits when written again");
    }
}

/// OpenTelemetry's process context (the `OTEL_CTX` mapping, OTEP 4719): its header, then
/// its payload, a protobuf Resource.
pub fn otel_process_context(data: &[u8]) {
    use crate::context::otel_process::{consistent, decode_resource, Header, HEADER_LEN};
    if let Ok(header) = Header::parse(data) {
        let _ = consistent(&header, header.published_at_ns);
        let _ = decode_resource(data.get(HEADER_LEN..).unwrap_or_default());
    }
    let _ = decode_resource(data);
}

/// A reader of outside bytes.
pub type Reader = fn(&[u8]);

/// A memory image of a live Ruby (`image::capture`, seeded by bench/fuzz from the Rubies
/// this machine has, one of them tagged) under the stack walker and the tag reader: a
/// snapshot and its tags, and every thread sampled twice.
pub fn memory_image(data: &[u8]) {
    let Some(image) = crate::image::load(data) else {
        return;
    };
    let mut spy = image.spy();
    let _ = spy.snapshot();
    let _ = spy.snapshot_tags();
    for _ in 0..2 {
        let _ = spy.sample(crate::spy::ThreadSelection::All);
    }
}

/// A memory image of a live Ruby's heap as a census read it (`image::capture` with its
/// census: pages, their headers, shapes, tables, class names) under the census.
pub fn heap_image(data: &[u8]) {
    let Some(image) = crate::image::load(data) else {
        return;
    };
    let mut spy = image.spy();
    if let Ok(census) = crate::census::take(spy.target_view(), Default::default()) {
        let _ = render::text(&census, 100);
    }
}

/// Every target by name, for the fuzz script and the regression test.
pub const TARGETS: [(&str, Reader); 10] = [
    ("raw_profile", raw_profile),
    ("census_file", census_file),
    ("http_request", http_request),
    ("elf", elf),
    ("maps", maps),
    ("live_set", live_set),
    ("memory_image", memory_image),
    ("heap_image", heap_image),
    ("otel_thread_record", otel_thread_record),
    ("otel_process_context", otel_process_context),
];
