# frozen_string_literal: true

require "json"
require "tmpdir"
require_relative "spec_helper"
require "rbspy_ext"

# Views that do not bill waiting as work (issue 37): in every format, a sample whose thread
# waited for the GVL or ran the GC has a leaf of its own below the frame it stood in
# ([waiting for GVL], [GC marking]...), so a frame's self samples are the samples it ran in.
# One target, waits_and_gc (two threads crunching Math.sqrt in Cruncher#crunch and a main
# thread churning garbage, all three after the GVL), recorded in user space and in the
# kernel; every format is read back and compared with the profile's own stacks and states.
RSpec.describe "state leaves in every view" do
  include RubySpyTest::Recording
  include RubySpyTest::GoPprof

  # The leaf of each state that has one (a BPF no_gvl sample gets [waiting for GVL] in a
  # Ruby frame, where it can only be taking the GVL back, and none in a C function).
  LEAVES = { "waiting_for_gvl" => "[waiting for GVL]", "gc" => "[GC]", "gc_marking" => "[GC marking]",
             "gc_sweeping" => "[GC sweeping]", "gc_compacting" => "[GC compacting]" }.freeze

  def leaf(stack)
    return LEAVES[stack[:state]] unless stack[:state] == "no_gvl"

    top = stack[:frames].first
    top&.c_function? ? nil : "[waiting for GVL]"
  end

  # What every view should bill each sample to as self: its leaf, or its innermost frame's
  # label. By label => samples; +idle: false+ leaves blocked threads out, as the shaped views do.
  def expected_self(profile, idle: true)
    profile.stacks.each_with_object(Hash.new(0)) do |s, out|
      next if !idle && s[:state] == "blocked"

      name = leaf(s) || s[:frames].first&.label
      out[name] += s[:samples] if name
    end
  end

  # A format's frame names (label path, label - path, label (C function)...) => labels.
  def labels_of(profile)
    profile.stacks.flat_map { |s| s[:frames] }.uniq.each_with_object({}) do |f, out|
      ["#{f.label} #{f.path}", "#{f.label} - #{f.path}", "#{f.label} (C function)", f.label].each { |n| out[n] = f.label }
    end.merge(LEAVES.values.to_h { |l| [l, l] })
  end

  def by_label(profile, self_samples)
    known = labels_of(profile)
    self_samples.each_with_object(Hash.new(0)) do |(name, n), out|
      next if name == "[no Ruby frames]"

      out[known.fetch(name) { raise "#{name.inspect} is no frame of the profile" }] += n
    end
  end

  # Every view's self samples by label, each read back from what its writer wrote.
  def views(profile, dir)
    ms = 1000.0 / profile.rate
    pb = profile.write(File.join(dir, "p.pb.gz"), format: :pprof)
    {
      summary: RubySpyTest::ViewSelf.summary_table(profile.render(:summary), "Top 20 functions by self samples"),
      functions: profile.functions.to_h { |f| [f[:label], f[:self]] },
      collapsed: RubySpyTest::ViewSelf.collapsed(profile.render(:collapsed)),
      flamegraph: RubySpyTest::ViewSelf.flamegraph(profile.render(:flamegraph)),
      speedscope: RubySpyTest::ViewSelf.speedscope(profile.render(:speedscope), ms),
      pprof: RubySpyTest::ViewSelf.pprof_top(go_pprof("-top", "-sample_index=samples", "-nodecount=100000", "-nodefraction=0", pb)),
      callgrind: RubySpyTest::ViewSelf.callgrind(profile.render(:callgrind))
    }.transform_values { |v| by_label(profile, v) }
  end

  # The lines summary's self table: "path:line label" of the innermost frame, or the leaf.
  def check_lines(profile)
    want = profile.stacks.each_with_object(Hash.new(0)) do |s, out|
      top = s[:frames].first
      name = leaf(s) || (top && "#{top.path}:#{top.lineno} #{top.label}")
      out[name] += s[:samples] if name
    end
    got = RubySpyTest::ViewSelf.summary_table(profile.render(:lines), "Top 20 source lines by self samples")
    expect(got).not_to be_empty
    expect(got).to eq(want.slice(*got.keys)), "lines: got #{got}, want #{want}"
    # The table is the top 20: nothing left out had more samples than its last row.
    expect(want.except(*got.keys).values.max.to_i).to be <= got.values.min if got.size == 20
  end

  def check_views(profile, dir)
    check_lines(profile)
    every = expected_self(profile)
    busy = expected_self(profile, idle: false)
    views(profile, dir).each do |view, got|
      want = %i[collapsed flamegraph speedscope].include?(view) ? busy : every
      # The summary lists the top 20 functions only.
      want = want.select { |name, _| got.key?(name) } if view == :summary
      expect(got.reject { |_, n| n.zero? }).to eq(want.reject { |_, n| n.zero? }), "#{view}: got #{got}, want #{want}"
    end
  end

  def samples(profile, state, label = nil)
    profile.stacks.select { |s| s[:state] == state && (label.nil? || s[:frames].first&.label == label) }
           .sum { |s| s[:samples] }
  end

  # Every span of the timeline rooted in a state with a leaf ends in that leaf, and no other.
  def timeline_consistent(profile)
    doc = JSON.parse(profile.render(:timeline))
    doc["profiles"].each_index do |i|
      timeline_spans(doc, i).each_key do |names|
        band = names.first[/\A\[(\w+)\]\z/, 1] or next # a tag band first: none here
        expect(names.last).to eq(LEAVES.fetch(band, names.last)), names.inspect
        expect(LEAVES.values).not_to include(names.last), names.inspect unless LEAVES.key?(band) || band == "no_gvl"
      end
    end
  end

  before(:all) do
    @dir = Dir.mktmpdir("rubyspy-leaves")
  end

  after(:all) { FileUtils.rm_rf(@dir) }

  it "bills the busy frame its running samples and the leaves the rest, in user space" do
    target = start_target("waits_and_gc")
    profile = record_until_samples(target.pid, samples: 3000, rate: 999)
    crunch = samples(profile, "running", "Cruncher#crunch")
    waiting = samples(profile, "waiting_for_gvl")
    marking = samples(profile, "gc_marking")
    # Three threads after one GVL: each waits most of the time; the churn runs the GC.
    expect(waiting).to be > 0.3 * profile.samples
    expect(marking + samples(profile, "gc_sweeping")).to be > 0
    check_views(profile, @dir)
    functions = profile.functions.to_h { |f| [f[:label], f] }
    expect(functions["Cruncher#crunch"][:self]).to eq(crunch)
    expect(functions["[waiting for GVL]"]).to include(self: waiting, total: waiting, state_leaf: true, path: "")
    # The running samples alone give the same self samples, without leaves.
    running = profile.select(state: :running)
    expect(running.functions.to_h { |f| [f[:label], f[:self]] }["Cruncher#crunch"]).to eq(crunch)
    expect(running.functions.map { |f| f[:label] }).not_to include(*LEAVES.values)
    gc = profile.select(state: %i[gc_marking gc_sweeping])
    expect(gc.samples).to eq(marking + samples(profile, "gc_sweeping"))
    expect { profile.select(state: :sleeping) }
      .to raise_error(ArgumentError, /unknown thread state "sleeping"; states are running, waiting_for_gvl, /)
    # The old shape: waits and GC billed to the frame they stood in.
    bare = RubySpyTest::ViewSelf.collapsed(profile.render(:collapsed, state_leaves: false))
    expect(bare.keys & LEAVES.values).to eq([])
    expect(bare.values.sum).to eq(expected_self(profile, idle: false).values.sum)
    timeline_consistent(profile)
    raw = profile.write(File.join(@dir, "p.raw"), format: :raw)
    %w[summary pprof callgrind collapsed].each do |format|
      leaves = rubyspy!("report", "--input", raw, "--format", format, binmode: true).stdout
      bare = rubyspy!("report", "--input", raw, "--format", format, "--no-state-leaves", binmode: true).stdout
      expect(leaves.b).to eq(profile.render(format).b)
      expect(bare.b).to eq(profile.render(format, state_leaves: false).b)
      expect(bare.b).not_to eq(leaves.b)
    end
  end

  it "does the same for the BPF sampler's samples, taken on a CPU" do
    skip "loading BPF programs needs root (CAP_BPF and CAP_PERFMON)" unless Process.uid.zero?
    target = start_target("waits_and_gc")
    profile = record_until_samples(target.pid, samples: 1500, rate: 999, mode: :bpf)
    # A thread waiting for the GVL sleeps: the kernel samples running and GC.
    expect(samples(profile, "running", "Cruncher#crunch")).to be > 0
    expect(samples(profile, "gc_marking") + samples(profile, "gc_sweeping")).to be > 0
    check_views(profile, @dir)
    functions = profile.functions.to_h { |f| [f[:label], f[:self]] }
    expect(functions["Cruncher#crunch"]).to eq(samples(profile, "running", "Cruncher#crunch"))
    timeline_consistent(profile)
  end
end
