# frozen_string_literal: true

# Loaded on first use of RubySpy::Profile::FORMATS, EXTENSIONS or VIEW_FORMATS (see profile.rb).
require_relative "../rbspy_ext"

module RubySpy
  class Profile
    # The file name extension for each format (what +rubyspy record+ and the RSpec
    # integration name their files with): the extension's table (`Format` in
    # core/src/output/mod.rs). Empty where rbspy_ext runs without native code.
    EXTENSIONS = NativeProfile::FORMATS
    # Output formats for {#write} and {#render}.
    FORMATS = EXTENSIONS.keys.freeze
    # The formats that take {#render}'s view keywords (+per_thread:+, +lines:+, +idle:+,
    # +state:+, +tag:+).
    VIEW_FORMATS = NativeProfile::VIEW_FORMATS
  end
end
