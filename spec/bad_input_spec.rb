# frozen_string_literal: true

require_relative "spec_helper"
require "rbspy_ext"
require "tmpdir"
require "zlib"

# Bad input at every entry point, as a table: each example's name is the input and the outcome
# it must get, a specific error (a RubySpy::Error subclass, TypeError or ArgumentError) and,
# from the CLI, a non-zero exit with one line on stderr. Never a Rust panic, a segfault or a
# backtrace. (Recorder options, pids and formats have their own rows in recorder_spec.rb and
# cli_spec.rb.)
RSpec.describe "bad input" do
  # What must never reach a user: Rust's panic message, a crash, a Ruby backtrace.
  NEVER = /panicked|RUST_BACKTRACE|Segmentation fault|\[BUG\]|\.rb:\d+:in /

  def expect_cli_failure(args, exit_status, message)
    run = rubyspy!(*args, exitstatus: exit_status)
    expect(run.stderr.lines.size).to eq(1), run.to_s
    expect(run.stderr).to start_with("rubyspy: ").and match(message)
    expect(run.stderr + run.stdout).not_to match(NEVER), run.to_s
  end

  describe "the Ruby API" do
    [
      ["RubySpy.snapshot(nil)", -> { RubySpy.snapshot(nil) }, TypeError, /Integer/],
      ["RubySpy.snapshot(1.5)", -> { RubySpy.snapshot(1.5) }, TypeError, /Integer/],
      ["RubySpy.snapshot(2**40)", -> { RubySpy.snapshot(2**40) }, ArgumentError, /from 1 to 2147483647/],
      ["RubySpy.snapshot(4_194_305) (above pid_max)", -> { RubySpy.snapshot(4_194_305) }, RubySpy::NoSuchProcess, /4194305/],
      ["RubySpy.attach(Process.pid, force_version: \"9.9.9\")", -> { RubySpy.attach(Process.pid, force_version: "9.9.9") },
       RubySpy::UnsupportedVersion, /9\.9\.9/],
      ["RubySpy.attach(Process.pid, force_version: \"banana\")", -> { RubySpy.attach(Process.pid, force_version: "banana") },
       RubySpy::UnsupportedVersion, /banana/],
      ["RubySpy.attach(Process.pid, force_version: 3)", -> { RubySpy.attach(Process.pid, force_version: 3) }, TypeError, /String/],
      ["RubySpy.tag(\"k\" => 1) { }", -> { RubySpy.tag("k" => 1) {} }, TypeError, /Symbols/],
      ["RubySpy.tag(k: 1) without a block", -> { RubySpy.tag(k: 1) }, ArgumentError, /block/],
      ["RubySpy::State.new(**2000 tags)", -> { RubySpy::State.new(**(1..2000).to_h { |i| [:"k#{i}", i] }) },
       ArgumentError, /1024/],
      ["RubySpy::State.new.apply! on a State from another class", -> { RubySpy::State.apply("x") }, TypeError, /State/],
      ["Profile.load(nil)", -> { RubySpy::Profile.load(nil) }, TypeError, /NilClass/],
      ["Profile.load(\"/nonexistent.raw\")", -> { RubySpy::Profile.load("/nonexistent.raw") }, Errno::ENOENT, /nonexistent/],
      ["Profile.load(a directory)", -> { RubySpy::Profile.load("/tmp") }, Errno::EISDIR, %r{/tmp}],
    ].each do |input, call, error, message|
      it "#{input} → #{error}" do
        expect { call.call }.to raise_error(error, message)
      end
    end
  end

  describe "raw profile files" do
    before(:context) do
      @dir = Dir.mktmpdir("rbspy-bad-raw-")
      @good = File.join(@dir, "good.raw")
      RubySpy.record(Process.pid, rate: 500) { 20_000.times { |i| i.to_s * 3 } }.write(@good, format: :raw)
      @bytes = File.binread(@good)
    end
    after(:context) { FileUtils.rm_rf(@dir) }

    def corrupt(name, bytes)
      path = File.join(@dir, name)
      File.binwrite(path, bytes)
      path
    end

    cases = {
      "an empty file" => ->(_b) { "" },
      "the first 10 bytes" => ->(b) { b[0, 10] },
      "all but the closing brace and newline" => ->(b) { b[0...-2] },
      "half the file" => ->(b) { b[0, b.bytesize / 2] },
      "one byte flipped in the header" => ->(b) { b.dup.tap { |c| c.setbyte(8, c.getbyte(8) ^ 0xff) } },
      "every 97th byte flipped" => lambda { |b|
        b.dup.tap { |c| (0...c.bytesize).step(97) { |i| c.setbyte(i, c.getbyte(i) ^ 0x5a) } }
      },
      "4 KiB of random bytes" => ->(_b) { Random.new(7).bytes(4096) },
      "gzip of random bytes" => ->(_b) { Zlib.gzip(Random.new(8).bytes(4096)) },
      "a gzip file cut in half" => ->(b) { Zlib.gzip(b).then { |z| z[0, z.bytesize / 2] } },
      "a collapsed-stacks text file" => ->(_b) { "main;work 10\n" },
    }
    cases.each do |what, make|
      it "Profile.load of #{what} → RubySpy::InvalidProfile" do
        path = corrupt("#{what.tr(' ', '_')}.raw", make.call(@bytes))
        expect { RubySpy::Profile.load(path) }.to raise_error(RubySpy::InvalidProfile, /#{Regexp.escape(path)}/)
      end

      it "rubyspy report --input <#{what}> → exit 1, one line" do
        path = corrupt("cli_#{what.tr(' ', '_')}.raw", make.call(@bytes))
        expect_cli_failure(["report", "--input", path, "--format", "summary"], 1, /#{Regexp.escape(path)}/)
      end
    end

    it "every truncation of a real raw file (each of 64 lengths) → RubySpy::InvalidProfile, never a crash" do
      lengths = (0...64).map { |i| i * @bytes.bytesize / 64 }
      lengths.each do |n|
        path = corrupt("cut_#{n}.raw", @bytes[0, n])
        expect { RubySpy::Profile.load(path) }.to raise_error(RubySpy::InvalidProfile), "cut at #{n} of #{@bytes.bytesize}"
      end
    end
  end

  describe "CLI flags" do
    [
      [%w[snapshot --pid abc], 2, /pid/],
      [%w[snapshot --pid -5], 2, /pid/],
      [%w[snapshot --pid 0], 2, /pid/],
      [%w[snapshot --pid], 2, /pid/],
      [%w[snapshot --pid 1 --threads bogus], 2, /threads/],
      [%w[snapshot --pid 1 --frobnicate], 2, /frobnicate/],
      [%w[record --pid 1 --rate 0], 2, /rate/],
      [%w[record --pid 1 --rate fast], 2, /rate/],
      [%w[record --pid 1 --rate 1e9], 2, /rate/],
      [%w[record --pid 1 --duration -1], 2, /duration/],
      [%w[record --pid 1 --duration soon], 2, /duration/],
      [%w[record --pid 1 --threads some], 2, /threads/],
      [%w[record --pid 4194305 --duration 1], 1, /4194305/],
      [%w[report], 2, /input/],
      [%w[report --input /nonexistent.raw], 1, /nonexistent/],
      [%w[tags --pid abc], 2, /pid/],
      [%w[tags --pid 4194305], 1, /4194305/],
    ].each do |args, exit_status, message|
      it "rubyspy #{args.join(' ')} → exit #{exit_status}, one line" do
        expect_cli_failure(args, exit_status, message)
      end
    end
  end
end
