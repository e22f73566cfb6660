# frozen_string_literal: true

require_relative "spec_helper"
require "rbspy_ext"

# The tagging API in this process. What readers outside see is in spec/tags_spec.rb.
RSpec.describe "RubySpy.tag and RubySpy::State" do
  # The table ruby_profiler_state points at on this thread must be the current fiber's.
  def published_matches_current?
    current = RubySpy::State.current
    RubySpy::State.published_address == (current ? current.table_address : 0)
  end

  it "holds tags for the block, merged over the enclosing ones, and restores them after" do
    expect(RubySpy.tags).to eq({})
    RubySpy.tag(request_id: "abc", user: 42) do
      expect(RubySpy.tags).to eq(request_id: "abc", user: 42)
      RubySpy.tag(user: 7, endpoint: :show) do
        expect(RubySpy.tags).to eq(request_id: "abc", user: 7, endpoint: :show)
        expect(published_matches_current?).to be true
      end
      expect(RubySpy.tags).to eq(request_id: "abc", user: 42)
      expect(published_matches_current?).to be true
    end
    expect(RubySpy.tags).to eq({})
    expect(RubySpy::State.published_address).to eq(0)
  end

  it "restores the previous tags when the block raises, and returns the block's value" do
    RubySpy.tag(a: 1) do
      expect { RubySpy.tag(b: 2) { raise "boom" } }.to raise_error(RuntimeError, "boom")
      expect(RubySpy.tags).to eq(a: 1)
      expect(RubySpy.tag(c: 3) { :value }).to eq(:value)
    end
  end

  it "gives each fiber its own tags and follows fiber switches" do
    seen = []
    f = Fiber.new do
      RubySpy.tag(fiber: "inner") do
        seen << [RubySpy.tags, published_matches_current?]
        Fiber.yield
        seen << [RubySpy.tags, published_matches_current?]
      end
    end
    RubySpy.tag(fiber: "outer") do
      f.resume
      seen << [RubySpy.tags, published_matches_current?]
      f.resume
      seen << [RubySpy.tags, published_matches_current?]
    end
    expect(seen).to eq([[{ fiber: "inner" }, true], [{ fiber: "outer" }, true],
                        [{ fiber: "inner" }, true], [{ fiber: "outer" }, true]])
  end

  it "installs its fiber-switch hook only when a process first tags, and fibers made before follow" do
    # A fresh process: in this one earlier examples have installed the hook already.
    code = <<~RUBY
      require "rbspy_ext"
      before = RubySpy::State.hook_installed?
      early = Fiber.new { RubySpy.tag(f: 1) { Fiber.yield RubySpy::State.published_address } }
      main_table = nil
      inner = RubySpy.tag(m: 2) do
        main_table = RubySpy::State.current.table_address
        [early.resume, RubySpy::State.published_address]
      end
      puts [before, RubySpy::State.hook_installed?, inner[0] != 0 && inner[0] != main_table,
            inner[1] == main_table].inspect
    RUBY
    out = IO.popen([RbConfig.ruby, "-I", File.expand_path("../lib", __dir__), "-e", code], &:read)
    expect(out.strip).to eq("[false, true, true, true]")
  end

  it "publishes no table for something else stored under its fiber-local's name" do
    RubySpy.tag(a: 1) {} # the hook is installed
    f = Fiber.new do
      Thread.current[:__rubyspy_ext_state__] = "not a state"
      Fiber.yield
      RubySpy::State.published_address # the hook has just looked at the String
    end
    f.resume
    expect(f.resume).to eq(0)
    expect(RubySpy::State.published_address).to eq(0)
  end

  it "leaves the resumer's tags published when a tagged fiber finishes" do
    RubySpy.tag(who: "resumer") do
      f = Fiber.new { RubySpy::State.new(who: "fiber").apply! && :done }
      expect(f.resume).to eq(:done)
      expect(f.alive?).to be false
      expect(RubySpy.tags).to eq(who: "resumer")
      expect(published_matches_current?).to be true
    end
  end

  it "starts fibers and threads created inside a tag block with the tags of that moment" do
    fiber = thread = nil
    RubySpy.tag(request_id: "r1") do
      fiber = Fiber.new { |x| [x, RubySpy.tags] }
      thread = Thread.new(5) { |x| [x, RubySpy.tags, published_matches_current?] }
    end
    expect(fiber.resume(:arg)).to eq([:arg, { request_id: "r1" }])
    expect(thread.value).to eq([5, { request_id: "r1" }, true])
    expect(Thread.new { RubySpy.tags }.value).to eq({})
  end

  it "starts threads made by Thread.start and Thread.fork (which skip #initialize) with the tags too" do
    started = forked = nil
    RubySpy.tag(job: "j") do
      started = Thread.start(1) { |x| [x, RubySpy.tags, published_matches_current?] }
      forked = Thread.fork { RubySpy.tags }
    end
    expect(started.value).to eq([1, { job: "j" }, true])
    expect(forked.value).to eq(job: "j")
    expect(Thread.start { RubySpy.tags }.value).to eq({})
  end

  it "builds immutable states for frameworks that keep their own context" do
    base = RubySpy::State.new(service: "billing")
    child = base.with(request_id: "x")
    expect(base.to_h).to eq(service: "billing")
    expect(child.to_h).to eq(service: "billing", request_id: "x")
    expect(child).to eq(RubySpy::State.new(service: "billing", request_id: "x"))
    child.apply!
    expect(RubySpy.tags).to eq(service: "billing", request_id: "x")
    expect(published_matches_current?).to be true
    RubySpy::State.apply(nil)
    expect(RubySpy.tags).to eq({})
  end

  describe "bad input" do
    it "names a key that is not a Symbol" do
      expect { RubySpy.tag("user" => 1) {} }.to raise_error(TypeError, /tag keys must be Symbols, got "user" \(String\)/)
      expect { RubySpy::State.new(1 => 2) }.to raise_error(TypeError, /got 1 \(Integer\)/)
    end

    it "needs a block" do
      expect { RubySpy.tag(a: 1) }.to raise_error(ArgumentError, /needs a block/)
      expect(RubySpy.tags).to eq({})
    end

    it "rejects a non-Hash and a non-State" do
      expect { RubySpy::State.apply("x") }.to raise_error(TypeError, /RubySpy::State or nil/)
      expect { RubySpy::State.new(**"x") }.to raise_error(TypeError)
    end

    it "holds up to 1024 tags and refuses more" do
      many = (1..1024).to_h { |i| [:"k#{i}", i] }
      RubySpy.tag(**many) { expect(RubySpy.tags.size).to eq(1024) }
      expect { RubySpy.tag(**many, k1025: 0) {} }.to raise_error(ArgumentError, /1025 tags is more than the 1024/)
    end

    it "keeps RSS flat when tagging in a loop" do
      rss = -> { File.read("/proc/self/status")[/VmRSS:\s+(\d+)/, 1].to_i }
      20_000.times { |i| RubySpy.tag(i: i, s: "v#{i}") {} }
      GC.start
      before = rss.call
      200_000.times { |i| RubySpy.tag(i: i, s: "v#{i}") {} }
      GC.start
      expect(rss.call - before).to be < 20_000, "RSS grew by #{rss.call - before} kB"
    end
  end

  describe "values under the GC" do
    # Applies and then drops +count+ states with String values (one per fresh state), so the
    # only thing that may keep them is the extension; returns [weak refs, table addresses].
    def retire_states(count)
      refs = []
      addresses = []
      count.times do |i|
        state = RubySpy::State.new(note: "retired-#{i}-" + "x" * 40)
        addresses << state.table_address
        state.apply!
        RubySpy::State.apply(nil)
        refs << WeakRef.new(state)
      end
      [refs, addresses]
    end

    # The table at +address+ in this process, read the way a reader outside does.
    def table_size_at(address)
      File.open("/proc/self/mem", "rb") do |mem|
        mem.seek(address)
        mem.read(16).unpack("Q<Q<")
      end
    end

    it "keeps a table it stopped publishing, and its values, for 10 ms, then lets the GC have it" do
      require "weakref"
      refs, addresses = retire_states(20)
      GC.start(full_mark: true, immediate_sweep: true)
      # A reader that read the pointer just before it changed still finds the same table.
      expect(refs.count(&:weakref_alive?)).to eq(20)
      expect(addresses.map { |a| table_size_at(a) }).to all(eq([1, 2]))
      expect(refs.map { |r| r.to_h[:note] }).to eq(Array.new(20) { |i| "retired-#{i}-" + "x" * 40 })
      sleep 0.05
      RubySpy.tag(later: 1) {} # retiring another state ends the grace of the older ones
      GC.start(full_mark: true, immediate_sweep: true)
      # Ruby's conservative stack scan may keep one alive by chance; the grace keeps none.
      expect(refs.count(&:weakref_alive?)).to be <= 1
    end

    it "keeps tag values alive and in place through GC.compact" do
      RubySpy.tag(payload: "x" * 100, list: [1, 2, 3]) do
        ids = RubySpy.tags.transform_values(&:object_id)
        GC.start
        GC.compact if GC.respond_to?(:compact)
        expect(RubySpy.tags).to eq(payload: "x" * 100, list: [1, 2, 3])
        expect(RubySpy.tags.transform_values(&:object_id)).to eq(ids)
        expect(published_matches_current?).to be true
      end
    end

    it "survives GC.stress while tagging across fibers" do
      GC.stress = true
      begin
        result = RubySpy.tag(k: "v") do
          Fiber.new { RubySpy.tag(j: "w") { RubySpy.tags } }.resume
        end
      ensure
        GC.stress = false
      end
      expect(result).to eq(k: "v", j: "w")
    end
  end
end
