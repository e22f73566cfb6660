//! OpenTelemetry's process context (OTEP 4719, version 2): a small mapping named `OTEL_CTX`
//! whose header points at a protobuf `opentelemetry.proto.resource.v1.Resource`, the SDK's
//! resource attributes (`service.name`, ...) and, for the thread context of OTEP 4947
//! (super::otel_thread), `threadlocal.schema_version` and `threadlocal.attribute_key_map`.
//!
//! The header, 32 bytes, host byte order:
//!
//! | bytes | field |
//! |---|---|
//! | 0..8 | signature, `OTEL_CTX`, written last |
//! | 8..12 | version, 2 |
//! | 12..16 | payload_size |
//! | 16..24 | published_at_ns: 0 while an update is under way |
//! | 24..32 | payload: its address |
//!
//! A reader checks the signature and version, reads `published_at_ns` (not 0), the
//! payload, then `published_at_ns` again: the same time means the payload is whole.
//! The extension publishes with [`Header::encode`] and [`encode_resource`]; readers use
//! [`Header::parse`], [`consistent`] and [`decode_resource`].
use prost::Message;

/// The mapping's name: `memfd_create`'s, or `PR_SET_VMA_ANON_NAME`'s.
pub const NAME: &str = "OTEL_CTX";
/// What `/proc/PID/maps` shows for a mapping that holds a process context, by how it was
/// made: a memfd, a named shared anonymous mapping, a named private one.
pub const MAPS_NAMES: [&str; 3] = [
    "/memfd:OTEL_CTX",
    "[anon_shmem:OTEL_CTX]",
    "[anon:OTEL_CTX]",
];
pub const SIGNATURE: [u8; 8] = *b"OTEL_CTX";
pub const VERSION: u32 = 2;
pub const HEADER_LEN: usize = 32;
/// The largest payload a reader reads: a resource is a few hundred bytes; a size past this
/// is not one.
pub const MAX_PAYLOAD: u32 = 1 << 20;
/// The offset of `published_at_ns` (a reader reads it again after the payload).
pub const PUBLISHED_AT: usize = 16;

/// The schema of the thread context this project writes (OTEP 4947's name while it is
/// experimental).
pub const SCHEMA_VERSION: &str = "tlsdesc_v1_dev";
pub const SCHEMA_VERSION_KEY: &str = "threadlocal.schema_version";
pub const KEY_MAP_KEY: &str = "threadlocal.attribute_key_map";

/// A header, as read or to be written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub version: u32,
    pub payload_size: u32,
    /// 0 while the writer updates the payload.
    pub published_at_ns: u64,
    pub payload: u64,
}

/// Why a mapping gives no process context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Not `OTEL_CTX` (not one, or not written yet: the signature comes last).
    Signature,
    /// A version this reader does not know.
    Version(u32),
    /// `published_at_ns` is 0, or changed while the payload was read: read again.
    Updating,
    /// The payload is larger than [`MAX_PAYLOAD`], or is not a Resource.
    Payload,
}

impl Header {
    /// The header at the start of `raw`: its signature and version checked.
    pub fn parse(raw: &[u8]) -> Result<Header, Refused> {
        let raw = raw.get(..HEADER_LEN).ok_or(Refused::Signature)?;
        if raw[..8] != SIGNATURE {
            return Err(Refused::Signature);
        }
        let u32_at = |at: usize| u32::from_ne_bytes(raw[at..at + 4].try_into().unwrap());
        let u64_at = |at: usize| u64::from_ne_bytes(raw[at..at + 8].try_into().unwrap());
        let header = Header {
            version: u32_at(8),
            payload_size: u32_at(12),
            published_at_ns: u64_at(PUBLISHED_AT),
            payload: u64_at(24),
        };
        if header.version != VERSION {
            return Err(Refused::Version(header.version));
        }
        if header.published_at_ns == 0 {
            return Err(Refused::Updating);
        }
        if header.payload_size > MAX_PAYLOAD {
            return Err(Refused::Payload);
        }
        Ok(header)
    }

    /// The header's bytes, signature included (a writer stores the signature last).
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[..8].copy_from_slice(&SIGNATURE);
        out[8..12].copy_from_slice(&self.version.to_ne_bytes());
        out[12..16].copy_from_slice(&self.payload_size.to_ne_bytes());
        out[16..24].copy_from_slice(&self.published_at_ns.to_ne_bytes());
        out[24..32].copy_from_slice(&self.payload.to_ne_bytes());
        out
    }
}

/// Whether a payload read after `first` is whole: `published_at_ns` read again after it
/// (`again`) is the same.
pub fn consistent(first: &Header, again: u64) -> Result<(), Refused> {
    match again == first.published_at_ns {
        true => Ok(()),
        false => Err(Refused::Updating),
    }
}

/// The protobuf messages of the payload: `opentelemetry.proto.resource.v1.Resource` and
/// the parts of `common.v1` it uses, with their field numbers.
pub mod proto {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Resource {
        #[prost(message, repeated, tag = "1")]
        pub attributes: Vec<KeyValue>,
        #[prost(uint32, tag = "2")]
        pub dropped_attributes_count: u32,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct KeyValue {
        #[prost(string, tag = "1")]
        pub key: String,
        #[prost(message, optional, tag = "2")]
        pub value: Option<AnyValue>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct AnyValue {
        #[prost(oneof = "Value", tags = "1, 2, 3, 4, 5, 7")]
        pub value: Option<Value>,
    }

    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Value {
        #[prost(string, tag = "1")]
        String(String),
        #[prost(bool, tag = "2")]
        Bool(bool),
        #[prost(int64, tag = "3")]
        Int(i64),
        #[prost(double, tag = "4")]
        Double(f64),
        #[prost(message, tag = "5")]
        Array(ArrayValue),
        #[prost(bytes, tag = "7")]
        Bytes(Vec<u8>),
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ArrayValue {
        #[prost(message, repeated, tag = "1")]
        pub values: Vec<AnyValue>,
    }
}

/// A process context's content: the resource attributes as text, and the thread
/// context's schema and key map when it has them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProcessContext {
    /// Every attribute but the `threadlocal.*` ones, values as text (an array's elements
    /// joined by ", ").
    pub attributes: Vec<(String, String)>,
    pub schema_version: Option<String>,
    /// Attribute names by key index (OTEP 4947's `threadlocal.attribute_key_map`).
    pub key_map: Vec<String>,
}

fn string(value: &str) -> Option<proto::AnyValue> {
    Some(proto::AnyValue {
        value: Some(proto::Value::String(value.to_string())),
    })
}

/// The payload for `attributes` (string values) and the thread context's `key_map`.
pub fn encode_resource(attributes: &[(String, String)], key_map: &[String]) -> Vec<u8> {
    let mut kvs: Vec<proto::KeyValue> = (attributes.iter())
        .map(|(key, value)| proto::KeyValue {
            key: key.clone(),
            value: string(value),
        })
        .collect();
    kvs.push(proto::KeyValue {
        key: SCHEMA_VERSION_KEY.into(),
        value: string(SCHEMA_VERSION),
    });
    let names = key_map.iter().filter_map(|k| string(k)).collect();
    kvs.push(proto::KeyValue {
        key: KEY_MAP_KEY.into(),
        value: Some(proto::AnyValue {
            value: Some(proto::Value::Array(proto::ArrayValue { values: names })),
        }),
    });
    proto::Resource {
        attributes: kvs,
        dropped_attributes_count: 0,
    }
    .encode_to_vec()
}

/// An attribute value as text.
fn text(value: &proto::AnyValue) -> String {
    match &value.value {
        Some(proto::Value::String(s)) => s.clone(),
        Some(proto::Value::Bool(b)) => b.to_string(),
        Some(proto::Value::Int(i)) => i.to_string(),
        Some(proto::Value::Double(d)) => d.to_string(),
        Some(proto::Value::Array(a)) => a.values.iter().map(text).collect::<Vec<_>>().join(", "),
        Some(proto::Value::Bytes(b)) => super::otel_thread::hex(b),
        None => String::new(),
    }
}

/// A payload's content; Refused::Payload when it is not a Resource.
pub fn decode_resource(payload: &[u8]) -> Result<ProcessContext, Refused> {
    let resource = proto::Resource::decode(payload).map_err(|_| Refused::Payload)?;
    let mut out = ProcessContext::default();
    for kv in resource.attributes {
        let value = kv.value.unwrap_or_default();
        match (kv.key.as_str(), &value.value) {
            (SCHEMA_VERSION_KEY, _) => out.schema_version = Some(text(&value)),
            (KEY_MAP_KEY, Some(proto::Value::Array(a))) => {
                out.key_map = a.values.iter().map(text).collect();
            }
            _ => out.attributes.push((kv.key, text(&value))),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_reads_back_at_the_oteps_offsets() {
        let header = Header {
            version: VERSION,
            payload_size: 77,
            published_at_ns: 1_790_000_000_000_000_000,
            payload: 0x7f00_dead_b000,
        };
        let raw = header.encode();
        assert_eq!(&raw[..8], b"OTEL_CTX");
        assert_eq!(u32::from_ne_bytes(raw[8..12].try_into().unwrap()), 2);
        assert_eq!(u32::from_ne_bytes(raw[12..16].try_into().unwrap()), 77);
        assert_eq!(
            u64::from_ne_bytes(raw[24..32].try_into().unwrap()),
            0x7f00_dead_b000
        );
        assert_eq!(Header::parse(&raw), Ok(header));
        assert_eq!(consistent(&header, header.published_at_ns), Ok(()));
        assert_eq!(consistent(&header, 0), Err(Refused::Updating));
    }

    #[test]
    fn a_header_being_written_or_not_one_is_refused() {
        let header = Header {
            version: VERSION,
            payload_size: 10,
            published_at_ns: 5,
            payload: 1,
        };
        let mut raw = header.encode();
        raw[16..24].fill(0);
        assert_eq!(Header::parse(&raw), Err(Refused::Updating));
        let mut raw = header.encode();
        raw[..8].fill(0);
        assert_eq!(Header::parse(&raw), Err(Refused::Signature));
        let raw = Header {
            version: 1,
            ..header
        }
        .encode();
        assert_eq!(Header::parse(&raw), Err(Refused::Version(1)));
        let raw = Header {
            payload_size: MAX_PAYLOAD + 1,
            ..header
        }
        .encode();
        assert_eq!(Header::parse(&raw), Err(Refused::Payload));
        assert_eq!(
            Header::parse(&header.encode()[..31]),
            Err(Refused::Signature)
        );
    }

    #[test]
    fn the_resource_carries_attributes_the_schema_and_the_key_map() {
        let attributes = vec![
            ("service.name".to_string(), "shop".to_string()),
            ("service.instance.id".to_string(), "a1b2".to_string()),
        ];
        let keys = vec!["trace endpoint".to_string(), "tenant".to_string()];
        let payload = encode_resource(&attributes, &keys);
        let read = decode_resource(&payload).unwrap();
        assert_eq!(read.attributes, attributes);
        assert_eq!(read.schema_version.as_deref(), Some(SCHEMA_VERSION));
        assert_eq!(read.key_map, keys);
        assert_eq!(decode_resource(&[0xff, 0xff, 0xff]), Err(Refused::Payload));
    }
}
