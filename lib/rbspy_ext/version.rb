# frozen_string_literal: true

module RubySpy
  # The gem's version; the Rust crates carry the same number in Cargo.toml.
  VERSION = "0.1.0"
end
