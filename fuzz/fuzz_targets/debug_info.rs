#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| rbspy_ext_core::outside::debug_info(data));
