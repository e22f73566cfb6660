# frozen_string_literal: true

require_relative "spec_helper"
require "rbspy_ext"
require "tmpdir"

# Live objects by allocation site, read from outside (RubySpy.heap(pid, sites: true),
# rubyspy heap --by site): a target that tracks its own allocations publishes its live set,
# and the census of its heap joins it. The target (spec/fixtures/heap_sites.rb) keeps 10,000
# Leaky objects from one line and drops 100,000 Churned ones; at rate 1 every allocation is a
# sample, so the join's counts are exact, and Ruby's own caller_locations gives the line.
# Runs on the host Ruby and on every Ruby of the matrix (script/test).
RSpec.describe "the heap census by allocation site" do
  include RubySpyTest::Recording
  include RubySpyTest::GoPprof

  ruby = RubySpyTest::TargetRuby.current

  before { skip "no rbspy_ext built for #{ruby}: run script/rubies ext #{ruby.name}" unless ruby.extension? }

  it "puts the leaked class under the line that allocated it, as Ruby names it (#{ruby})" do
    target = start_target("heap_sites", "1")
    census = RubySpy.heap(target.pid, sites: true)
    expect(census.sites_note).to be_nil
    # Ruby 2.7 publishes only when tracking stops, so the fixture stops there.
    expect(census.sites_tracking?).to eq(ruby.version >= Gem::Version.new("3.0"))
    leaky = census.sites.find { |c| c[:name] == "Leaky" }
    expect(leaky).to include(type: "T_OBJECT", objects: 10_000)
    top = leaky[:sites].first
    expect(top).to include(objects: 10_000, samples: 10_000)
    # Class#new, a C function, where there is one: 4.0 compiles `new` into the caller, and
    # 2.7's rb_profile_frames leaves C functions out.
    expect(top[:frames].take_while(&:c_function?).map(&:label)).to all(eq("Class#new"))
    code = top[:frames].find { |f| !f.c_function? }
    info = target.info
    expect([code.path, code.lineno]).to eq([info["leak_path"], info["leak_line"]])
    # Ruby says "block in leak" (3.4: "block in Sites.leak"); rb_profile_frames, which the
    # tracker reads, names a block's frame by its method.
    expect(info["leak_label"]).to end_with(code.base_label)
    # What the collection freed left the live set: nothing of Churned (a slot or two may
    # stay referenced from the machine stack).
    churned = census.sites.find { |c| c[:name] == "Churned" }
    expect(churned ? churned[:sites].sum { |s| s[:objects] } : 0).to be <= 2
    allocated = census.allocations.sites.select { |s| s[:class] == "Churned" }.sum { |s| s[:allocated] }
    expect(allocated).to eq(100_000)
  end

  it "says sites need tracking when the target does not track (#{ruby})" do
    untracked = start_target("heap_sites", "0")
    census = RubySpy.heap(untracked.pid, sites: true)
    expect(census.sites).to be_nil
    expect(census.sites_note).to match(/has published no allocations: .*RUBYSPY_ALLOCATIONS=1/)
    expect(census["Leaky"]).to include(objects: 10_000)
    without = start_target("heap_leak")
    expect(RubySpy.heap(without.pid, sites: true).sites_note).to match(/has not loaded rbspy_ext/)
    expect(RubySpy.heap(without.pid).sites_note).to be_nil
  end

  it "prints each class's sites, and writes Go's heap profile go tool pprof reads (rubyspy heap --by site)" do
    skip "checked once, on the host's Ruby" unless ruby.host?
    target = start_target("heap_sites", "1")
    line = target.info["leak_line"]
    out = rubyspy!("heap", "--pid", target.pid, "--by", "site", "--limit", 5).stdout
    sites = out.lines.drop_while { |l| !l.start_with?("allocation sites of live objects") }
    expect(sites).not_to be_empty, out
    leaky = sites.index { |l| l =~ /\A\s+10000\s.*\bLeaky \(T_OBJECT\)/ }
    expect(leaky).not_to be_nil, sites.join
    expect(sites[leaky + 1]).to match(/\A\s+10000\s.*100\.0%\s+Class#new < Sites\.leak \(spec\/fixtures\/heap_sites\.rb:#{line}\)/)
    Dir.mktmpdir do |dir|
      pb = File.join(dir, "heap.pb.gz")
      run = rubyspy!("heap", "--pid", target.pid, "--by", "site", "--output", pb)
      expect(run.stderr).to match(/wrote the tracked allocations/)
      top = go_pprof("-top", "-cum", "-sample_index=inuse_objects", "-tagfocus=class=Leaky", pb)
      expect(top).to match(/^\s*0\s+0%\s+[\d.]+%\s+10000\s+[\d.]+%\s+Sites\.leak$/)
      expect(top).to match(/^\s*10000\s.*\sClass#new$/)
    end
    untracked = start_target("heap_leak")
    run = rubyspy!("heap", "--pid", untracked.pid, "--by", "site")
    expect(run.stderr).to match(/has not loaded rbspy_ext/)
    expect(run.stdout).to match(/\(T_OBJECT\)/)
    run = rubyspy!("heap", "--pid", untracked.pid, "--by", "line", exitstatus: 2)
    expect(run.stderr).to match(/invalid argument: --by line/)
  end
end
