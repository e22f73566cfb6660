# frozen_string_literal: true

require "fileutils"
require "rbconfig"
require "tmpdir"
require_relative "paths"

module RubySpyTest
  # Which Ruby runs the fixture targets. RUBYSPY_TARGET_RUBY=NAME:inside|outside[:JIT] picks a
  # Ruby from script/rubies (NAME as in `script/rubies list`): `inside` runs a Debian Ruby in
  # its chroot (container-style: the paths in the target's /proc/PID/maps do not exist for the
  # reader), `outside` runs the same binary on the host through the chroot's loader, or a
  # Ruby built from source (or one of RUBYSPY_EXTRA_RUBIES) as itself. JIT (yjit or zjit)
  # turns that JIT on in every target (--yjit, --zjit); mn=N starts every target with
  # RUBY_MN_THREADS=N (M:N threads, 3.3+), unless a spec sets its own. Unset: the Ruby
  # running the specs.
  class TargetRuby
    JITS = %w[yjit zjit].freeze

    attr_reader :name, :mode, :root, :jit, :mn

    def self.current
      @current ||= new(ENV["RUBYSPY_TARGET_RUBY"])
    end

    def initialize(spec)
      @name, @mode, *extras = spec.to_s.split(":") if spec && !spec.empty?
      return unless @name

      extras.each do |extra|
        if JITS.include?(extra) && @jit.nil?
          @jit = extra
        elsif extra.match?(/\Amn=-?\d+\z/) && @mn.nil?
          @mn = extra.delete_prefix("mn=")
        else
          @mode = nil # reported below
        end
      end
      unless %w[inside outside].include?(@mode)
        raise ArgumentError, "RUBYSPY_TARGET_RUBY=#{spec}: expected NAME:inside or NAME:outside, " \
                             "optionally followed by :#{JITS.join(' or :')} and :mn=N"
      end

      line = IO.popen([File.join(ROOT, "script", "rubies"), "list"], &:read).lines
               .map(&:split).find { |fields| fields[0] == @name }
      raise ArgumentError, "#{@name} is not built (script/rubies build #{@name})" unless line

      @root = line[2]
      @version = line[1]
      on_host = line[4] != "chroot"
      raise ArgumentError, "#{@name} runs on the host as itself, with no chroot: use #{@name}:outside" if on_host && inside?

      sync_fixtures if inside?
    end

    # The target Ruby's version, as a Gem::Version.
    def version
      Gem::Version.new(host? ? RUBY_VERSION : @version)
    end

    # Whether fixtures can load rbspy_ext into this Ruby: the host's (rake compile), or a
    # chroot's with its own build in lib/rbspy_ext/X.Y/ (script/rubies ext NAME).
    def extension?
      host? || File.exist?(File.join(ROOT, "lib", "rbspy_ext", version.segments.first(2).join("."), "rbspy_ext.so"))
    end

    def host?
      @name.nil?
    end

    def inside?
      @mode == "inside"
    end

    def to_s
      return "host Ruby #{RUBY_VERSION}" if host?

      "#{@name} (#{[@mode, @jit, @mn && "RUBY_MN_THREADS=#{@mn}"].compact.join(', ')})"
    end

    # What every target of this Ruby is started with (RUBY_MN_THREADS for :mn=N).
    def env
      @mn ? { "RUBY_MN_THREADS" => @mn } : {}
    end

    # The command that runs `args` from the repository root.
    def command(*args)
      return [RbConfig.ruby, *args] if host?

      flags = @jit ? ["--#{@jit}"] : []
      proc = @proc && inside? ? ["--proc"] : []
      [File.join(ROOT, "script", "rubies"), "run", @name, @mode, "--chdir", ROOT, *proc, "--", *flags, *args]
    end

    # The same Ruby, with /proc mounted in its chroot when it runs inside one (script/rubies
    # run --proc), for a fixture that reads its own memory through /proc, as one serving its
    # own profiles does. A container always has /proc; a bare chroot does not.
    def with_proc
      dup.tap { |ruby| ruby.instance_variable_set(:@proc, true) }
    end

    # Where a developer keeps OpenTelemetry's Ruby SDK by hand: a directory of gems, each a
    # directory with its gemspec and lib/ (the SDK, its API, the Rack and ActionPack
    # instrumentations and what they need). No registry these machines reach serves it, so
    # CI runs without it and the specs that need it say so.
    OTEL_SDK_ENV = "RUBYSPY_OTEL_SDK"

    # Why the SDK's specs cannot run here, or nil when they can.
    def self.otel_sdk_missing
      dir = ENV.fetch(OTEL_SDK_ENV, "")
      return "no OpenTelemetry Ruby SDK (#{OTEL_SDK_ENV}=DIR names a copy kept by hand; no registry here serves it)" if dir.empty?
      return "#{OTEL_SDK_ENV}=#{dir}: no gem directories with a lib/ there" if Dir[File.join(dir, "*", "lib")].empty?

      nil
    end

    # The lib directories of the OpenTelemetry gems in RUBYSPY_OTEL_SDK, as this Ruby's
    # targets see them (copied into the chroot at the same path when inside one), or nil
    # where there are none.
    def otel_gem_libs
      return nil if TargetRuby.otel_sdk_missing

      gems = File.expand_path(ENV.fetch(OTEL_SDK_ENV))

      if inside? && !File.directory?(File.join(@root, gems))
        FileUtils.mkdir_p(File.join(@root, File.dirname(gems)))
        FileUtils.cp_r(gems, File.join(@root, gems))
      end
      Dir[File.join(gems, "*", "lib")].sort + logger_lib
    end

    # The API needs the logger gem, a bundled gem from Ruby 4.0 that a Ruby built without its
    # bundled gems lacks: Debian's (sid's Ruby 3.4, pure Ruby) stands in, from a directory
    # holding links to it alone.
    def logger_lib
      return [] if host? || inside? || version < Gem::Version.new("4.0")

      sid = IO.popen([File.join(ROOT, "script", "rubies"), "list"], &:read).lines.map(&:split).find { |f| f[0] == "sid" }
      logger = sid && File.join(sid[2], "usr/lib/ruby", "#{sid[1][/\A\d+\.\d+/]}.0", "logger.rb")
      return [] unless logger && File.exist?(logger)

      dir = File.join(ROOT, "tmp", "logger-from-sid")
      FileUtils.mkdir_p(dir)
      [logger, logger.delete_suffix(".rb")].each do |path|
        link = File.join(dir, File.basename(path))
        File.symlink(path, link) unless File.symlink?(link)
      end
      [dir]
    end

    # Where a path the target uses lives for the specs (inside a chroot: under its root).
    def host_path(path)
      inside? ? File.join(@root, path) : path
    end

    # A fresh directory both sides can use; returns [path for the target, path for specs].
    def mktmpdir(prefix)
      return [Dir.mktmpdir(prefix)] * 2 unless inside?

      host = Dir.mktmpdir(prefix, File.join(@root, "tmp"))
      [host.delete_prefix(@root), host]
    end

    private

    # The chroot sees the fixtures (and lib/, for the fixtures that load rbspy_ext) at the
    # same absolute path as the host, so relative and absolute paths in its backtraces look
    # as they would on a host.
    def sync_fixtures
      %w[spec lib].each do |dir|
        target = File.join(@root, ROOT, dir)
        FileUtils.rm_rf(target)
        FileUtils.mkdir_p(File.dirname(target))
        FileUtils.cp_r(File.join(ROOT, dir), target)
      end
    end
  end
end
