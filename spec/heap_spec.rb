# frozen_string_literal: true

require_relative "spec_helper"
require "rbspy_ext"
require "json"
require "tmpdir"

# The heap census (RubySpy.heap, rubyspy heap) against the target's own answers: a target of
# known populations (spec/fixtures/heap_populations.rb) that reports what
# ObjectSpace.count_objects, each_object, memsize_of and GC.stat say of the very heap the
# census read. Runs on the host Ruby and on every Ruby of the matrix (script/test).
RSpec.describe "the heap census" do
  include RubySpyTest::Recording

  # The target parked on its sleep line after its last allocation (see the fixture), with
  # its census and its answers.
  def census_and_answers
    target = start_target("heap_populations")
    [target, *target.census_and_answers]
  end

  it "counts every class and type exactly as the target's own ObjectSpace does, and its bytes as memsize_of" do
    target, census, answers = census_and_answers
    # Tangled's class went too complex where Ruby says so (3.2 to 4.0): its ivar tables are
    # among the bytes compared below.
    version = RubySpyTest::TargetRuby.current.version
    if version >= Gem::Version.new("3.2") && version < Gem::Version.new("4.1")
      expect(target.info["tangled_shape"]).to eq('"too_complex_shape":true')
    end
    ratios = answers.fetch("classes").map do |c|
      row = census[c["name"]]
      format("%s %d/%d objects, bytes %.4f of memsize", c["name"][/\A\w+|#<Class/], row ? row[:objects] : 0, c["objects"],
             row ? row[:bytes].fdiv(c["memsize"]) : 0)
    end
    warn "#{RubySpyTest::TargetRuby.current}: census of #{census.objects} objects, #{census.slots[:pages]} pages, " \
         "#{(census.duration * 1000).round(1)} ms; #{ratios.join("; ")}"
    answers.fetch("classes").each do |expected|
      row = census[expected.fetch("name")]
      expect(row).not_to be_nil, "no row for #{expected["name"]} in #{census.classes.first(10)}"
      expect(row[:objects]).to eq(expected.fetch("objects")), "#{expected["name"]}: #{row}"
      memsize = expected.fetch("memsize")
      expect(row[:bytes]).to be_within(memsize * 0.05).of(memsize), "#{expected["name"]}: #{row} vs memsize #{memsize}"
    end
    # Widgets and the anonymous class's objects hold nothing outside their slots: their
    # bytes are slot bytes.
    %w[Widget].each do |name|
      expected = answers["classes"].find { |c| c["name"] == name }
      expect(census[name][:slot_bytes]).to be_within(expected["memsize"] * 0.01).of(expected["memsize"])
    end
    # ObjectSpace.count_objects' keys, as the census has them.
    by_type = census.types.to_h { |t| [t[:type], t[:objects]] }
    slots = census.slots
    counted = answers.fetch("counts").to_h do |type, _|
      [type, case type
             when "TOTAL" then slots[:total_slots]
             when "FREE" then slots[:free_slots]
             when "T_ZOMBIE" then slots[:zombie_slots]
             when "T_MOVED" then slots[:moved_slots]
             else by_type.fetch(type, 0)
             end]
    end
    expect(counted).to eq(answers["counts"])
    expect(census.slots[:live_slots]).to eq(answers.fetch("live_slots"))
    expect(census.slots).to include(unreadable_pages: 0, garbage_slots: 0)
    expect(census).not_to be_partial
  end

  it "counts objects that other Ractors made and keep, each Ractor's heap apart where each owns one" do
    skip "no Ractors before 3.0" if RubySpyTest::TargetRuby.current.version < Gem::Version.new("3.0")
    target = start_target("heap_ractors")
    info = target.info
    census, answers = target.census_and_answers
    keepers = info.fetch("keepers")
    foos = info.fetch("main_foos") + (keepers.size * info.fetch("per_keeper"))
    warn "#{RubySpyTest::TargetRuby.current}: #{census["Foo"][:objects]} Foos in the census, #{answers["main_foos"]} " \
         "by the main Ractor's each_object; heaps: " +
         census.ractors.map { |r| "#{r[:name] || r[:id]} #{r[:objects]} objects/#{r[:total_slots]} slots" }.join(", ")
    expect(census["Foo"]).to include(objects: foos, type: "T_OBJECT")
    expect(census.slots).to include(unreadable_pages: 0, garbage_slots: 0)
    expect(census).not_to be_heaps_changed
    # Ruby's own answer says whether each Ractor owns its heap: the main Ractor's
    # ObjectSpace then sees its own Foos alone. The census under test does not decide it.
    next expect(census.ractors).to eq([]) unless answers["main_foos"] == info.fetch("main_foos")

    # Each Ractor owns its heap: the main Ractor's ObjectSpace sees its own heap alone,
    # which the census's row for it matches slot for slot; every keeper's heap holds its
    # Foos; and the heaps add up to the census.
    main, *others = census.ractors
    expect(main).to include(id: 1, state: "running", total_slots: answers["counts"]["TOTAL"],
                            free_slots: answers["counts"]["FREE"])
    expect(others.map { |r| r.values_at(:name, :state) }).to eq(keepers.map { |k| [k, "running"] })
    expect(others.map { |r| r[:objects] }).to all(be >= info.fetch("per_keeper"))
    %i[pages total_slots free_slots].each { |k| expect(census.ractors.sum { |r| r[k] }).to eq(census.slots[k]) }
    expect(census.ractors.sum { |r| r[:objects] }).to eq(census.objects)
    expect(census.ractors.sum { |r| r[:bytes] }).to eq(census.classes.sum { |r| r[:bytes] })
    expect(RubySpy::Census.from_json(census.render(:json)).ractors).to eq(census.ractors)
  end

  it "reads a heap that allocates, frees and compacts under it: bounded drift, no crash, no hang" do
    target = start_target("heap_churn")
    keepers = target.info.fetch("keepers")
    handle = RubySpy.attach(target.pid)
    # At least 40 censuses, and more (up to 200) until 10 have settled: many do not settle in
    # 4 passes, since the fixture compacts without pause (29 of 40 on 3.2 in one CI run).
    settled = ->(c) { !c.moving? && !c.pages_changed? && c.slots[:unreadable_pages].zero? }
    censuses = []
    censuses << handle.heap until censuses.size >= 200 || (censuses.size >= 40 && censuses.count(&settled) >= 10)
    counts = censuses.map { |c| c["Keeper"]&.fetch(:objects) || 0 }
    drift = counts.map { |n| (n - keepers).abs.fdiv(keepers) }
    warn "#{RubySpyTest::TargetRuby.current}: Keepers seen in #{censuses.size} censuses of a heap under churn" \
         "#{" and GC.compact" if target.info["compacts"]}: #{counts.minmax.join("..")} of #{keepers} " \
         "(drift up to #{(drift.max * 100).round(2)} %), moved slots up to " \
         "#{censuses.map { |c| c.slots[:moved_slots] }.max}, garbage up to #{censuses.map { |c| c.slots[:garbage_slots] }.max}, " \
         "unreadable pages up to #{censuses.map { |c| c.slots[:unreadable_pages] }.max}, " \
         "passes taken again #{censuses.sum(&:compactions)}, still moving in #{censuses.count(&:moving?)}, " \
         "pages freed while listed in #{censuses.count(&:pages_changed?)}, " \
         "settled #{censuses.count(&settled)}"
    # A pass that overlapped a compaction is taken again (up to 4): those that did not
    # overlap one count the Keepers, almost always exactly. Rarely one does not: once in 200
    # passes on 4.0 a pass during a lazy sweep took 46 of them for garbage, and once in CI
    # (about 1 in 800 passes) one on 2.7 saw 19,613, neither reproduced since the census
    # checks its page list and rereads pages swept while read. One still moving after 4
    # passes may see an object twice or not at all (before passes were taken again, drift
    # reached 76 % on 2.7), so it is only reported. So is one whose last pass still found
    # listed pages freed: its list may have been read halfway through the loop that frees
    # pages, without the pages at its top (before such passes were taken again, 1 census
    # in about 150 on trixie's 3.3 missed 137 to 2,426 Keepers). So is one whose page list
    # was read while the GC freed pages (pages_changed?): on 3.2, whose freed pages still
    # read, two CI runs saw 18,545 then. Settled passes that are not exact remain, fewer
    # than a fifth: with a core kept busy, 4 of 38 on the host's 3.1 missed up to 351
    # Keepers (CI, issue 47), with no pass moving or unreadable, before pages_changed?.
    stable = censuses.zip(counts).select { |c, _| settled.(c) }
    expect(stable.size).to be >= 5
    expect(stable.count { |_, n| n == keepers }).to be >= stable.size * 0.8
    stable.each { |_, n| expect(n).to be_within(keepers / 20).of(keepers) }
    expect(censuses.map(&:duration).max).to be < 5
    expect(Process.kill(0, target.pid)).to eq(1)
  end

  it "counts the calling process's own heap" do
    skip "checked once, on the host's Ruby" unless RubySpyTest::TargetRuby.current.host?
    klass = Class.new
    stash = Array.new(1234) { klass.new }
    census = RubySpy.heap(Process.pid)
    expect(census[klass.inspect]).to include(objects: 1234, type: "T_OBJECT")
    expect(census.pid).to eq(Process.pid)
    expect(stash.size).to eq(1234)
  end

  it "says the process exited when it exits in the middle of a census" do
    skip "checked once, on the host's Ruby" unless RubySpyTest::TargetRuby.current.host?
    # 20 million Objects: a census of some 300 ms, killed 50 ms in.
    script = 'KEEP = Array.new(20_000_000) { Object.new }; GC.start; $stdout.puts "ready"; $stdout.flush; sleep'
    popen_killed_after(RbConfig.ruby, "-e", script, kind: :popen2) do |_stdin, out, wait|
      expect(out.gets).to eq("ready\n")
      handle = RubySpy.attach(wait.pid)
      killer = Thread.new do
        sleep 0.05
        Process.kill(:KILL, wait.pid)
      end
      expect { handle.heap }.to raise_error(RubySpy::ProcessExited, /#{wait.pid}/)
      killer.join
      expect(wait.value.signaled?).to be(true)
    end
  end

  it "stops at max_bytes with a partial census, and names bad arguments" do
    target = start_target("heap_populations")
    partial = RubySpy.heap(target.pid, max_bytes: 1 << 20)
    expect(partial).to be_partial
    expect(partial.slots[:heap_bytes_total]).to be <= 1 << 20
    expect(partial.objects).to be > 0
    expect { RubySpy.heap(target.pid, max_bytes: 0) }.to raise_error(ArgumentError, /max_bytes/)
    expect { RubySpy.heap("1") }.to raise_error(TypeError, /pid must be an Integer/)
    sleeper = Process.spawn("sleep", "30")
    expect { RubySpy.heap(sleeper) }.to raise_error(RubySpy::NotRubyProcess)
    Process.kill(:KILL, sleeper)
    Process.wait(sleeper)
    expect { RubySpy.heap(sleeper) }.to raise_error(RubySpy::NoSuchProcess)
  end
end

RSpec.describe "rubyspy heap" do
  include RubySpyTest::Recording
  include RubySpyTest::GoPprof

  before { skip "checked once, on the host's Ruby" unless RubySpyTest::TargetRuby.current.host? }

  it "names the leaking class first in the diff of two censuses, and writes a pprof go tool pprof reads" do
    target = start_target("heap_leak")
    Dir.mktmpdir do |dir|
      a, b, pb = %w[a.json b.json heap.pb.gz].map { |f| File.join(dir, f) }
      rubyspy!("heap", "--pid", target.pid, "--output", a)
      Process.kill(:USR1, target.pid)
      target.result(".leaked.1")
      rubyspy!("heap", "--pid", target.pid, "--output", b)
      grew = rubyspy!("heap", "--diff", a, b).stdout.lines.drop_while { |l| !l.include?("classes grew") }
      expect(grew[2]).to match(/\+10000\s.*\bLeaky \(T_OBJECT\)/)
      deltas = RubySpy::Census.load(b) - RubySpy::Census.load(a)
      expect(deltas.find { |d| d[:name] == "Leaky" }).to include(objects: 10_000)

      rubyspy!("heap", "--pid", target.pid, "--output", pb)
      top = go_pprof("-top", "-sample_index=inuse_objects", pb)
      expect(top).to match(/^\s*10000\s.*\sLeaky$/)
      text = rubyspy("heap", "--pid", target.pid, "--limit", 5).stdout
      expect(text).to match(/live objects in \d+ slots/)
      expect(text.lines.grep(/\(T_/).size).to eq(5)
    end
  end

  it "keeps a census native: saved and loaded back, it renders and compares as the live one" do
    target = start_target("heap_leak")
    live = RubySpy.heap(target.pid)
    Dir.mktmpdir do |dir|
      path = live.save(File.join(dir, "census.json"))
      saved = JSON.parse(File.read(path), symbolize_names: true)
      loaded = RubySpy::Census.load(path)
      expect(loaded.to_h).to eq(live.to_h)
      # The file's rows are the live census's, which add their sum (:bytes).
      expect(live.classes.map { |row| row.except(:bytes) }).to eq(saved[:classes])
      expect(live.classes).to all(satisfy { |row| row[:bytes] == row[:slot_bytes] + row[:heap_bytes] })
      expect([live.objects, live.pid, live.slots[:pages]]).to eq([saved[:live_slots], target.pid, saved[:pages]])
      expect(loaded - live).to eq([])
      expect([loaded.render(:text), loaded.render(:pprof)]).to eq([live.render(:text), live.render(:pprof)])
      expect { RubySpy::Census.from_json("{}") }.to raise_error(RubySpy::InvalidCensus, /not a heap census/)
      expect { live - saved }.to raise_error(TypeError, /RubySpy::Census/)
    end
  end

  it "prints the top growers every --watch seconds until interrupted" do
    target = start_target("heap_leak")
    popen_killed_after(*rubyspy_command("heap", "--pid", target.pid, "--watch", 0.5), kind: :popen2e) do |stdin, out, wait|
      stdin.close
      expect(out.gets).to match(/\Awatching the heap of pid #{target.pid} \(\d+ live objects\)/)
      Process.kill(:USR1, target.pid)
      lines = []
      lines << out.gets until lines.any? { |l| l =~ /\+10000\s.*Leaky \(T_OBJECT\)/ } || lines.size > 200
      expect(lines.grep(/\A--- \d\d:\d\d:\d\d: \d+ live objects/)).not_to be_empty
      expect(lines.last).to match(/Leaky/)
      Process.kill(:INT, wait.pid)
      expect(exit_status(wait, "rubyspy heap --watch after SIGINT").exitstatus).to eq(0)
    end
  end

  it "says what is wrong with bad input" do
    Dir.mktmpdir do |dir|
      bad = File.join(dir, "bad.json")
      File.write(bad, "not json")
      expect(rubyspy!("heap", "--diff", bad, bad, exitstatus: 1).stderr).to match(/not a heap census/)
      expect(rubyspy!("heap", "--diff", bad, exitstatus: 2).stderr).to match(/two census files/)
      expect(rubyspy!("heap", exitstatus: 2).stderr).to match(/needs --pid/)
      expect(rubyspy!("heap", "--pid", 999_999_999, exitstatus: 1).stderr).to match(/no process/)
    end
  end
end
