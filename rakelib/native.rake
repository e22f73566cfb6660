# frozen_string_literal: true

require "rubygems/package"
require_relative "../lib/rbspy_ext/version"

# The precompiled ("fat") platform gem: one library per Ruby series, as the rb-sys gems do.
module NativeGem
  PLATFORM = "x86_64-linux"
  # The Rubies it carries, as script/rubies names them (host: this machine's own Ruby): the
  # series Debian has. A library for 3.0, 3.2 or 4.0 needs that Ruby's headers and
  # RbConfig to build against, and no registry these machines reach serves one: those
  # series install the source gem. Every library is compiled and linked in the bullseye
  # chroot, so none needs a glibc newer than bullseye's 2.31 (script/rubies, ext_one).
  RUBIES = %w[bullseye host trixie sid].freeze
  # Every Ruby series there has been from the oldest to the newest we carry: those between
  # them that we do not carry are the ones required_ruby_version must exclude.
  RUBY_SERIES = %w[2.7 3.0 3.1 3.2 3.3 3.4].freeze
  # Gem::Requirement has no "not 3.2.x": each patch release of a missing series is excluded
  # with its own !=. No series has had more than a dozen.
  PATCHES_EXCLUDED = 0..29
  STAGE = "tmp/native"

  module_function

  # The requirement that admits exactly the series carried (+["2.7", "3.1"]+): from the
  # oldest's x.y.0 to before the newest's next minor, minus every release of the series
  # between them that it lacks. Prereleases of a missing series are not excluded (RubyGems
  # calls them 3.2.0.preview1 and so on); the library loader says what to install there.
  def required_ruby_version(series)
    versions = series.map { |s| Gem::Version.new(s) }.sort
    lowest = versions.first
    major, minor = versions.last.segments
    missing = RUBY_SERIES.map { |s| Gem::Version.new(s) }
                         .select { |v| v.between?(lowest, versions.last) } - versions
    [">= #{lowest}.0", "< #{major}.#{minor + 1}.dev",
     *missing.flat_map { |v| PATCHES_EXCLUDED.map { |p| "!= #{v}.#{p}" } }]
  end

  # The source gem's specification made into the platform gem's: the Ruby code and the
  # libraries, no Rust sources and nothing to build at install time.
  def spec(series)
    spec = Gem::Specification.load("rbspy_ext.gemspec")
    spec.platform = Gem::Platform.new(PLATFORM)
    spec.extensions = []
    spec.files = spec.files.reject { |f| f.match?(%r{\A(?:ext|core|bindings)/|\ACargo\.}) } +
                 series.map { |s| "lib/rbspy_ext/#{s}/rbspy_ext.so" }
    spec.required_ruby_version = required_ruby_version(series)
    spec.description = spec.description.sub(/Rust core, built with cargo at install time\./,
                                             "Precompiled for Ruby #{series.join(', ')} on #{PLATFORM}.")
    spec
  end
end

desc "Build pkg/rbspy_ext-VERSION-#{NativeGem::PLATFORM}.gem with a library for every Ruby " \
     "released series script/rubies has (2.7 to 4.0; root, ~1 min each)"
task :native do
  stage = NativeGem::STAGE
  rm_rf stage
  sh "script/rubies", "build", *(NativeGem::RUBIES - ["host"])
  sh "script/rubies", "ext", "--out", "#{stage}/lib/rbspy_ext", *NativeGem::RUBIES
  series = Dir["#{stage}/lib/rbspy_ext/*/rbspy_ext.so"].map { |f| File.basename(File.dirname(f)) }
  spec = NativeGem.spec(series.sort_by { |s| Gem::Version.new(s) })
  (spec.files - spec.files.grep(%r{/rbspy_ext\.so\z})).each do |f|
    mkdir_p File.dirname(File.join(stage, f)), verbose: false
    cp f, File.join(stage, f), verbose: false
  end
  mkdir_p "pkg"
  built = Dir.chdir(stage) { Gem::Package.build(spec) }
  mv File.join(stage, built), "pkg/#{built}"
  puts "pkg/#{built}: Ruby #{series.join(', ')}"
end
