# frozen_string_literal: true

require_relative "spec_helper"
require "rbspy_ext"

# Takes caller_locations(0) and a snapshot of this very process on one line, so that the
# frame of this method has the same line number in both.
module SelfSnapshotProbe
  def self.capture
    expected, frames = caller_locations(0), RubySpy.snapshot(Process.pid)
    [expected, frames]
  end
end

# Fixtures that park their main thread in Kernel#sleep and record its backtrace_locations.
parked_scenarios = {
  "nested_methods" => "six nested plain methods",
  "nested_blocks" => "blocks five levels deep inside each/map/times/each_with_index/tap",
  "qualified_names" => "class methods, module_function, nested namespaces, singleton methods",
  "class_body" => "class, module and singleton class bodies still executing",
  "define_method" => "methods made with define_method",
  "eval_strings" => "eval with file and line, class_eval and instance_eval with strings",
  "required_method" => "a method in a file loaded with require",
  "park_in_require" => "top-level code of a file being required",
  "park_in_rescue" => "rescue clauses, in a method and in a block",
  "park_in_ensure" => "an ensure clause running while an exception unwinds",
  "fiber" => "a Fiber resumed from nested code",
  "deep_recursion" => "a method recursing 160 levels",
  "long_method" => "a long method re-entered from several of its own lines",
  "top_level_blocks" => "blocks at the top level of the script",
  "yield_and_procs" => "blocks run through yield, Proc#call, a lambda and &block",
  "super_chain" => "a chain of super calls through prepended and included modules",
  "method_missing" => "method_missing reached through public_send",
  "anonymous_classes" => "methods of Struct.new / Class.new / Module.new classes",
  "iterators" => "Kernel#loop, Hash#each, Integer#times, Array#each",
  "c_calls_c" => "C functions called directly from C functions",
}

RSpec.describe "RubySpy.snapshot" do
  def fixture_path(name)
    File.join("spec", "fixtures", "#{name}.rb")
  end

  describe "matches Ruby's own backtrace_locations of the parked main thread" do
    parked_scenarios.each do |scenario, what|
      it "for #{what} (#{scenario})" do
        target = start_target(scenario)
        frames = RubySpy.snapshot(target.pid)

        expect(frames).to be_an(Array)
        expect(frames).to all(be_a(RubySpy::Frame))
        expect(frames).to match_backtrace(target.frames, ruby_version: target.ruby_version)
        expect(target.health_problems).to eq([])
      end
    end
  end

  describe "labels (qualified the way Ruby 3.4 prints them, on every Ruby)" do
    it "qualifies class methods, blocks in them, module functions and namespaced instance methods" do
      target = start_target("qualified_names")
      frames = RubySpy.snapshot(target.pid)

      expect(frames.map(&:label)).to eq([
        "Kernel#sleep",
        "Park.here",
        "ping", # a singleton method of a plain object stays unqualified
        "block (4 levels) in Foo.build",
        "block in Billing::Invoice#total",
        "Array#sum",
        "Billing::Invoice#total",
        "block (3 levels) in Foo.build",
        "Util.helper",
        "block (2 levels) in Foo.build",
        "Array#map",
        "block in Foo.build",
        "Array#each",
        "Foo.build",
        "<main>",
      ])
      expect(frames.map(&:base_label)).to eq(%w[
        sleep here ping build total sum total build helper build map build each build <main>
      ])
    end

    it "names the innermost frame Kernel#sleep, a C function at the caller's line" do
      target = start_target("nested_methods")
      sleep_frame = RubySpy.snapshot(target.pid).first
      recorded = target.frames.first

      expect(sleep_frame.label).to eq("Kernel#sleep")
      expect(sleep_frame.base_label).to eq("sleep")
      expect(sleep_frame).to be_c_function
      expect(sleep_frame.path).to eq(recorded.path)
      expect(sleep_frame.path).to end_with("spec/fixtures/lib/park.rb")
      expect(sleep_frame.lineno).to eq(recorded.lineno)
      expect(sleep_frame.to_s).to eq("#{recorded.path}:#{recorded.lineno}:in 'Kernel#sleep'")
    end

    it "qualifies top-level methods with Object" do
      target = start_target("nested_methods")
      labels = RubySpy.snapshot(target.pid).map(&:label)

      expect(labels).to eq(["Kernel#sleep", "Park.here"] +
                           (1..6).to_a.reverse.map { |i| "Object#level#{i}" } + ["<main>"])
    end

    it "labels class, module and singleton-class bodies" do
      target = start_target("class_body")
      labels = RubySpy.snapshot(target.pid).map(&:label)

      expect(labels).to eq(["Kernel#sleep", "Park.here", "App::Config.load!", "<module:Config>",
                            "<class:App>", "<main>"])
    end

    it "qualifies each step of a super chain with the class or module that defines it" do
      target = start_target("super_chain")
      frames = RubySpy.snapshot(target.pid)

      expect(frames.map(&:label)).to eq(["Kernel#sleep", "Park.here", "Base#handle",
                                         "Audited#handle", "Service#handle", "Special#handle",
                                         "Instrumented#handle", "<main>"])
      expect(frames[2..-2].map(&:base_label).uniq).to eq(["handle"])
    end

    it "leaves methods of anonymous classes and modules unqualified" do
      target = start_target("anonymous_classes")
      labels = RubySpy.snapshot(target.pid).map(&:label)

      expect(labels).to eq(["Kernel#sleep", "Park.here", "total", "sum", "Named#call", "run",
                            "<main>"])
    end

    it "labels define_method bodies after the block they were written as" do
      target = start_target("define_method")
      labels = RubySpy.snapshot(target.pid).map(&:label)

      expect(labels).to eq(["Kernel#sleep", "Park.here", "block in <main>",
                            "block (3 levels) in <class:Widget>", "Widget#wrap",
                            "block (2 levels) in <class:Widget>", "Array#map",
                            "block in <class:Widget>", "<main>"])
    end

    it "labels blocks written at the top level of the script" do
      target = start_target("top_level_blocks")
      frames = RubySpy.snapshot(target.pid)

      expect(frames.map(&:label)).to eq(["Kernel#sleep", "Park.here", "block (2 levels) in <main>",
                                         "Integer#times", "block in <main>", "Array#each",
                                         "<main>"])
      expect(frames.select { |f| f.label.include?("<main>") }.map(&:path).uniq)
        .to eq([fixture_path("top_level_blocks")])
    end
  end

  describe "C functions" do
    it "flags exactly the C-implemented iterators (Integer#times is C before Ruby 3.3)" do
      target = start_target("iterators")
      frames = RubySpy.snapshot(target.pid)

      expect(frames.map(&:label)).to eq([
        "Kernel#sleep", "Park.here",
        "block (4 levels) in Scheduler#tick", "Array#each",
        "block (3 levels) in Scheduler#tick", "Integer#times",
        "block (2 levels) in Scheduler#tick", "Hash#each",
        "block in Scheduler#tick", "Kernel#loop",
        "Scheduler#tick", "<main>",
      ])
      # What is written in C depends on the target's Ruby: Integer#times and Kernel#loop moved
      # to Ruby (<internal:...>) in 3.3, and 4.0's YJIT defines Array#each in Ruby. The target
      # says which (a C method has no source_location); from 4.0 its backtrace no longer
      # does, since it prints such methods at their caller's location.
      c_methods = target.info.fetch("c_methods")
      flags = frames.map { |f| [f.label, f.c_function?] }
      expected_flags = frames.map { |f| [f.label, c_methods.include?(f.label)] }
      expect(flags).to eq(expected_flags)
      expect(c_methods).to include("Integer#times") if target.ruby_version < "3.3"
      expect(frames.find { |f| f.label == "Hash#each" }).to be_c_function
    end

    it "reports C functions called from C functions at the line of the Ruby code that called the first" do
      target = start_target("c_calls_c")
      frames = RubySpy.snapshot(target.pid)

      expect(frames.map(&:label)).to eq([
        "Kernel#sleep", "Park.here",
        "block (3 levels) in Object#rank", "Array#map",
        "block (2 levels) in Object#rank", "Hash#each", "Enumerable#each_with_index",
        "block in Object#rank", "Array#each", "Enumerable#sort_by",
        "Object#rank", "<main>",
      ])
      by_label = frames.to_h { |f| [f.label, f] }
      # The target's own answer: its Ruby and JIT decide what is written in C.
      c_methods = target.info.fetch("c_methods")
      expect(frames.map { |f| [f.label, f.c_function?] })
        .to eq(frames.map { |f| [f.label, c_methods.include?(f.label)] })
      # Hash#each is driven by each_with_index (C) with no Ruby frame between: both show the
      # line of the each_with_index call in the block.
      expect([by_label["Hash#each"].lineno, by_label["Enumerable#each_with_index"].lineno])
        .to eq([by_label["block in Object#rank"].lineno] * 2)
      if c_methods.include?("Array#each")
        expect([by_label["Array#each"].lineno, by_label["Enumerable#sort_by"].lineno])
          .to eq([by_label["Object#rank"].lineno] * 2)
      end
    end
  end

  describe "special frames" do
    it "shows only the frames of the running Fiber" do
      target = start_target("fiber")
      frames = RubySpy.snapshot(target.pid)

      expect(frames.last.label).to eq("block in Pipeline#stage_two")
      expect(frames.map(&:label)).not_to include("Pipeline#start", "Fiber#resume", "<main>")
      expect(frames).to match_backtrace(target.frames, ruby_version: target.ruby_version)
    end

    it "reads all 161 frames of a deep recursion with the right lines" do
      target = start_target("deep_recursion")
      frames = RubySpy.snapshot(target.pid)

      expect(frames.count { |f| f.base_label == "dive" && !f.label.start_with?("block") }).to eq(161)
      expect(frames.map(&:lineno)).to eq(target.frames.map(&:lineno))
    end

    it "gives each frame of the long method its own line" do
      target = start_target("long_method")
      frames = RubySpy.snapshot(target.pid)
      settle = frames.select { |f| f.label == "Ledger#settle" }

      expect(settle.map(&:lineno))
        .to eq(target.frames.select { |f| f.base_label == "settle" }.map(&:lineno))
      expect(settle.map(&:lineno).uniq.size).to eq(5)
    end

    it "keeps the file and line given to eval, and the (eval) path of instance_eval" do
      target = start_target("eval_strings")
      frames = RubySpy.snapshot(target.pid)
      paths = frames.map(&:path)

      expect(paths).to include("virtual.rb", "class_eval_src.rb")
      # instance_eval's path is "(eval)" before 3.3, "(eval at FILE:LINE)" since.
      expect(paths).to include(a_string_matching(/\A\(eval( at .+:\d+)?\)\z/))
      virtual = frames.find { |f| f.path == "virtual.rb" }
      recorded = target.frames.find { |f| f.path == "virtual.rb" }
      expect([virtual.lineno, virtual.absolute_path]).to eq([recorded.lineno, recorded.absolute_path])
      expect(virtual.lineno).to be >= 100
    end

    it "lists rescue clause frames separately exactly when Ruby does" do
      target = start_target("park_in_rescue")
      frames = RubySpy.snapshot(target.pid)

      expect(frames.size).to eq(target.frames.size)
      expect(frames.map(&:lineno)).to eq(target.frames.map(&:lineno))
      expect(frames.map(&:base_label)).to eq(target.frames.map(&:base_label))
    end
  end

  describe "repeated snapshots through one handle" do
    it "return equal results 50 times" do
      target = start_target("nested_blocks")
      handle = RubySpy.attach(target.pid)
      first = handle.snapshot

      expect(first).to match_backtrace(target.frames, ruby_version: target.ruby_version)
      49.times do |i|
        again = handle.snapshot
        expect(again).to eq(first), "snapshot #{i + 2} differed from the first:\n" +
                                    RubySpyTest::FrameComparison.side_by_side(again, first, target.ruby_version)
      end
      expect(target.health_problems).to eq([])
    end

    # A handle trusts what it cached of the stack's iseqs and method entries between full
    # validations. A compaction moves a running method's iseq and rewrites its definition's
    # pointer in place, while the method entry a frame points at stays where it is.
    it "return the same frames after compactions move the parked methods' code" do
      target = start_target("compacts_under_frames")
      handle = RubySpy.attach(target.pid)
      first = handle.snapshot
      expect(first).to match_backtrace(target.frames, ruby_version: target.ruby_version)
      expect(first.map(&:base_label)).to include("outer", "middle", "inner")

      3.times do |i|
        ask_to_compact("#{target.ready_path}.fifo")
        target.result(".done#{i + 1}", timeout: 60)
        wait_until_no_thread_holds_the_gvl(target.pid)
        again = handle.snapshot
        expect(again).to eq(first), "after compaction #{i + 1}:\n" +
                                    RubySpyTest::FrameComparison.side_by_side(again, first, target.ruby_version)
      end
      expect(target.health_problems).to eq([])
    end
  end

  # The compactor answers while it holds the GVL and gives it up only back in read(2); a
  # snapshot taken in between reads its stack, the GVL owner's, not the parked main thread's
  # (it did on a busy machine). A handle of its own watches, so that the handle under test
  # meets the moved code on its first read after the compaction.
  def wait_until_no_thread_holds_the_gvl(pid)
    watcher = RubySpy.attach(pid)
    states = nil
    wait_for("every thread off the GVL", timeout: 30, detail: -> { "states: #{states.inspect}" }) do
      states = watcher.thread_snapshots.map { |t| t[:state] }
      states.all? { |s| %w[blocked no_gvl].include?(s) }
    end
  end

  # Writes a line to the fixture's FIFO. Opening it without blocking fails with ENXIO when
  # the fixture does not hold it open (it has died), instead of waiting for good.
  def ask_to_compact(fifo)
    File.open(fifo, File::WRONLY | File::NONBLOCK) { |f| f.write("go\n") }
  end

  describe "several copies of one fixture" do
    it "reads each process on its own, through handles open at the same time" do
      targets = start_targets("qualified_names", 3)
      handles = targets.map { |t| RubySpy.attach(t.pid) }

      2.times do
        handles.zip(targets).each do |handle, target|
          expect(handle.snapshot).to match_backtrace(target.frames, ruby_version: target.ruby_version)
        end
      end
    end

    it "reads fresh processes one after another" do
      each_run("deep_recursion", times: 3) do |target, _i|
        expect(RubySpy.snapshot(target.pid))
          .to match_backtrace(target.frames, ruby_version: target.ruby_version)
      end
    end
  end

  describe "a busy target" do
    # StackChanged is documented as transient; a spinning loop keeps moving its pc.
    def snapshot_allowing_retries(pid, attempts: 3)
      attempts.times do |i|
        return RubySpy.snapshot(pid)
      rescue RubySpy::StackChanged
        raise if i == attempts - 1
      end
    end

    it "shows the main thread inside its CPU-bound loop" do
      target = start_target("busy_main")
      lines = fixture_line("busy_main", "spin-start")..fixture_line("busy_main", "spin-end")

      10.times do
        frames = snapshot_allowing_retries(target.pid)
        innermost = frames.reject(&:c_function?).first

        expect(innermost.label).to eq("Hasher#churn")
        expect(innermost.base_label).to eq("churn")
        expect(innermost.path).to eq(fixture_path("busy_main"))
        expect(lines).to cover(innermost.lineno)
        expect(frames.last.label).to eq("<main>")
      end
    end

    it "shows the thread that holds the GVL, not the sleeping main thread" do
      target = start_target("busy_thread")
      lines = fixture_line("busy_thread", "spin-start")..fixture_line("busy_thread", "spin-end")

      10.times do
        frames = snapshot_allowing_retries(target.pid)
        innermost = frames.reject(&:c_function?).first

        expect(innermost.label).to eq("Cruncher#crunch")
        expect(innermost.path).to eq(fixture_path("busy_thread"))
        expect(lines).to cover(innermost.lineno)
        expect(frames.last.label).to eq("block in <main>")
        expect(frames.map(&:label)).not_to include("Idler#idle_forever", "<main>", "Kernel#sleep")
      end
    end
  end

  describe "the calling process itself" do
    it "matches caller_locations taken on the same line" do
      expected_locations, frames = SelfSnapshotProbe.capture
      expected = RubySpyTest::FrameComparison.expected_from_locations(expected_locations)

      start = frames.index { |f| f.label == "SelfSnapshotProbe.capture" }
      expect(start).not_to be_nil, "no frame labelled SelfSnapshotProbe.capture in:\n" +
                                   frames.map(&:to_s).join("\n")
      # Only the frames of the snapshot call itself (lib/rbspy_ext and the C methods it
      # calls) come first.
      lib = File.expand_path("../lib", __dir__)
      expect(frames.first(start)).to all(satisfy { |f| f.path.start_with?(lib) })
      expect(frames.drop(start)).to match_backtrace(expected)
    end
  end
end
