# frozen_string_literal: true

require_relative "spec_helper"
require "rbspy_ext"
require "json"
require "net/http"
require "socket"
require "open3"
require "fileutils"

# The pprof listener (RubySpy::Server, core/src/serve) in real Ruby processes of the target
# Ruby, read with `go tool pprof` as a scraper would: a port of its own on native threads,
# answering while the GVL is held, and closed in forked children. The Puma examples (one
# scrape for a whole cluster) run on the host's Puma; spec/rails_spec.rb runs them on Rails.
RSpec.describe "the pprof listener" do
  include RubySpyTest::GoPprof

  target_ruby = RubySpyTest::TargetRuby.current
  # Fixtures that serve read their own memory through /proc, which a chroot lacks.
  serving_ruby = target_ruby.with_proc

  before do
    skip "no rbspy_ext built for #{target_ruby}: run script/rubies ext #{target_ruby.name}" unless target_ruby.extension?
  end

  # The directories gvl_holder compiled into (a loaded .so may be removed: Linux keeps it).
  after { FileUtils.rm_rf(@built) if @built }

  def get(port, path, timeout: 10)
    http = Net::HTTP.new("127.0.0.1", port)
    http.read_timeout = timeout
    http.get(path)
  end

  # The C extension that holds the GVL, compiled with the host's compiler against the target
  # Ruby's headers (no libruby is linked: a Ruby resolves an extension's symbols at load).
  def gvl_holder(ruby)
    script = 'print RbConfig::CONFIG.values_at("rubyhdrdir", "rubyarchhdrdir").join("\n")'
    out, status = Open3.capture2(*ruby.command("-rrbconfig", "-e", script))
    raise "cannot ask #{ruby} for its headers: #{out}" unless status.success?

    # A chroot's Ruby names paths inside its chroot, which the host sees under the chroot.
    includes = out.lines.map(&:chomp).map do |dir|
      File.directory?(dir) || ruby.host? ? dir : File.join(ruby.root, dir)
    end
    target_dir, host_dir = ruby.mktmpdir("rbspy-gvl-holder")
    (@built ||= []) << host_dir
    source = File.join(RubySpyTest::FIXTURES, "gvl_holder", "gvl_holder.c")
    so = File.join(host_dir, "gvl_holder.so")
    cc = ["cc", "-shared", "-fPIC", "-O1", *includes.flat_map { |d| ["-I", d] }, source, "-o", so]
    out, status = Open3.capture2e(*cc)
    raise "#{cc.join(' ')} failed:\n#{out}" unless status.success?

    File.join(target_dir, "gvl_holder.so")
  end

  it "serves the stack of every thread as text, each equal to its backtrace_locations" do
    target = start_target("pprof_listener", "park", ruby: serving_ruby)
    response = get(target.info["port"], "/debug/pprof/threads")
    expect(response.code).to eq("200")
    text = response.body
    expect(text).to start_with("Process #{target.pid}, Ruby #{target.ruby_version}, ")
    main = text[/^Thread #{target.pid} \(main\): blocked\n((?:    .*\n)*)/, 1]
    expect(main).not_to be_nil, text
    got = main.lines.map { |line| line.strip.match(/\A(.*):(-?\d+):in '(.*)'\z/).captures }
    expect(got.map { |path, line, _| [path, line.to_i] }).to eq(target.frames.map { |f| [f.path, f.lineno] })
    got.zip(target.frames).each do |(_, _, label), expected|
      expect(RubySpyTest::FrameComparison.label_matches?(label, expected.label, target.ruby_version)).to be(true),
                                                                                                      "#{label} for #{expected.label}"
    end
    burner = text[/^Thread \d+ \(burner\): (\w+)\n((?:    .*\n)*)/m, 2].to_s
    expect(burner).to include("in 'Listener.burn'")
  end

  it "answers go tool pprof while a C extension holds the GVL, with the stack that holds it" do
    so = gvl_holder(target_ruby)
    target = start_target("pprof_listener", "hold_gvl", so, ruby: serving_ruby)
    ticks = target_ruby.host_path(target.info["ticks"])
    port = target.info["port"]
    wait_for("the main thread in GvlHolder.hold") do
      RubySpy.snapshot(target.pid).map(&:label).first == "GvlHolder.hold"
    end
    # The ticker, which writes every 10 ms while it gets the GVL, has stopped.
    before = wait_for("the ticker to stop") do
      count = File.read(ticks)
      sleep 0.1
      count if File.read(ticks) == count
    end
    started = Process.clock_gettime(Process::CLOCK_MONOTONIC)
    threads = get(port, "/debug/pprof/threads").body
    out = go_pprof("-traces", "http://127.0.0.1:#{port}/debug/pprof/profile?seconds=2&rate=199")
    elapsed = Process.clock_gettime(Process::CLOCK_MONOTONIC) - started
    # Nothing in Ruby ran meanwhile: the ticker never took the GVL.
    expect(File.read(ticks)).to eq(before)
    expect(elapsed).to be < 5
    expect(threads).to match(/^Thread #{target.pid} \(main\): running\n    \S+:\d+:in 'GvlHolder.hold'\n    \S+pprof_listener.rb:\d+:in 'Listener.hold_gvl'\n/)
    samples = traces(out)
    main = samples.select { |s| s[:labels]["thread"] == "Thread #{target.pid} (main)" }
    expect(main).not_to be_empty
    expect(main.map { |s| [s[:functions].first(2), s[:labels]["state"]] }.uniq)
      .to eq([[%w[GvlHolder.hold Listener.hold_gvl], "running"]])
    expect(out).to match(/Duration: 2(\.\d+)?s/)
  end

  it "gives go tool pprof the waits for the GVL as a leaf of their own, not as the crunching frame's work" do
    target = start_target("pprof_listener", "contend", ruby: serving_ruby)
    response = get(target.info["port"], "/debug/pprof/profile?seconds=2&rate=199")
    expect(response.code).to eq("200")
    pb = File.join(Dir.mktmpdir("rubyspy-contend"), "profile.pb.gz")
    (@built ||= []) << File.dirname(pb)
    File.binwrite(pb, response.body)
    samples = traces(go_pprof("-traces", "-sample_index=samples", pb))
    crunchers = samples.select { |s| s[:labels]["thread"].to_s.match?(/\(crunch-[ab]\)/) }
    expect(crunchers).not_to be_empty
    # A waiting sample ends in its leaf, below the frame it stood in; a running one does not.
    samples.each do |s|
      expect(s[:functions].first == "[waiting for GVL]").to eq(s[:labels]["state"] == "waiting_for_gvl"), s.inspect
    end
    crunchers.each { |s| expect(s[:functions].join(" ")).to include("Listener.crunch") }
    count = ->(list, state) { list.select { |s| s[:labels]["state"] == state }.sum { |s| Integer(s[:value]) } }
    waited = count.(crunchers, "waiting_for_gvl")
    ran = count.(crunchers, "running")
    # Two threads after one GVL: each waits about as long as it runs.
    expect(waited).to be_between(0.3 * (waited + ran), 0.7 * (waited + ran))
    top = RubySpyTest::ViewSelf.pprof_top(go_pprof("-top", "-sample_index=samples", "-nodefraction=0", pb))
    # Every thread's waits (a helper thread of the fixture's may wait too) are the leaf's.
    expect(top["[waiting for GVL]"]).to eq(count.(samples, "waiting_for_gvl"))
    expect(top.values_at("block in Listener.crunch", "Math.sqrt", "Kernel#loop").compact.sum).to eq(ran)
    # state_leaves=0: the old shape, waits billed to the frame they stood in.
    bare = go_pprof("-top", "-nodefraction=0", "http://127.0.0.1:#{target.info["port"]}/debug/pprof/profile?seconds=1&state_leaves=0")
    expect(bare).to include("Listener.crunch")
    expect(bare).not_to include("[waiting for GVL]")
  end

  it "closes its socket in a forked child, which has no listener of its own unless it starts one" do
    target = start_target("pprof_listener", "fork", ruby: serving_ruby)
    port = target.info["port"]
    child = target.info["child"]
    report = JSON.parse(File.read(target_ruby.host_path(target.info["child_report"])))
    expect(report).to include("inherited" => nil, "parent_running" => false)
    expect(report["own_port"]).to be_a(Integer).and(be > 0)
    expect(report["own_port"]).not_to eq(port)
    listener = listening_inode(port)
    expect(socket_inodes(target.pid)).to include(listener)
    expect(socket_inodes(child)).not_to include(listener)
    # The parent still serves; the child's own listener serves the child.
    expect(get(port, "/debug/pprof/").body).to include("process #{target.pid}")
    expect(get(report["own_port"], "/debug/pprof/").body).to include("process #{child}")
  ensure
    Process.kill(:KILL, child) if child
  end

  it "serves a heap census at /debug/pprof/heap that go tool pprof reads, and as text with debug=1" do
    target = start_target("pprof_listener", "park", ruby: serving_ruby)
    port = target.info["port"]
    top = go_pprof("-top", "-sample_index=inuse_objects", "http://127.0.0.1:#{port}/debug/pprof/heap")
    # Every Ruby has Strings and the listener fixture's own class Listener (a Module).
    expect(top).to match(/^\s*\d+\s.*\sString$/)
    expect(top).to match(/Type: inuse_objects/)
    text = get(port, "/debug/pprof/heap?debug=1").body
    expect(text).to match(/\Aheap of pid #{target.pid} \(Ruby #{Regexp.escape(target.ruby_version)}\): \d+ live objects/)
    expect(text).to match(/^\s+\d+\s+\S+ \S+\s+\S+ \S+\s+String \(T_STRING\)$/)
    expect(get(port, "/debug/pprof/heap?pid=1").code).to eq("400")
    expect(get(port, "/debug/pprof/heap?debug=2").code).to eq("400")
  end

  # The function of the first row of `go tool pprof -top`.
  def top_function(out)
    out.lines.drop_while { |l| !l.include?("flat%") }[1].split.last
  end

  it "serves tracked allocations at /debug/pprof/allocs and /heap, which go tool pprof reads by code" do
    skip "Ruby 2.7 cannot be asked from the listener's thread (RubySpy.allocations works)" if target_ruby.version < Gem::Version.new("3.0")
    untracked = start_target("pprof_listener", "park", ruby: serving_ruby)
    expect(get(untracked.info["port"], "/debug/pprof/allocs").body).to match(/tracking is off/)
    expect(get(untracked.info["port"], "/debug/pprof/allocs").code).to eq("404")
    target = start_target("pprof_listener", "allocs", ruby: serving_ruby)
    base = "http://127.0.0.1:#{target.info['port']}/debug/pprof"
    # Some thousands of allocations: the leak's 2,000 Strings, some 80 samples at 1 KiB,
    # and 50 times that of churn. Waited for by count: after a fixed second a busy machine
    # had let the allocator run ten rounds, and the leak had no sample (head, a core busy).
    target.result(".allocated", timeout: 60)
    allocs = go_pprof("-top", "-sample_index=alloc_objects", "#{base}/allocs")
    expect(allocs).to match(/Type: alloc_objects/)
    expect(allocs).to match(/\sListener\.churn$/).and match(/\sListener\.leak$/)
    # Listener.churn allocates 50 times what Listener.leak does, but after a full GC only
    # the kept Strings (and the churn of the moment) are alive: Listener.leak is first.
    expect(top_function(allocs)).not_to eq("Listener.leak")
    heap = go_pprof("-top", "-sample_index=inuse_space", "#{base}/heap?gc=1")
    expect(heap).to match(/Type: inuse_space/)
    expect(top_function(heap)).to eq("Listener.leak")
    # census=1 is the census by class, as /heap serves without tracking.
    census = go_pprof("-top", "-sample_index=inuse_objects", "#{base}/heap?census=1")
    expect(census).to match(/^\s*\d+\s.*\sString$/)
    expect(get(target.info["port"], "/debug/pprof/allocs?gc=2").code).to eq("400")
    expect(get(target.info["port"], "/debug/pprof/allocs?seconds=1").code).to eq("400")
  end

  it "refuses a second profile while one runs (429), and bad parameters (400), over real HTTP" do
    target = start_target("pprof_listener", "park", ruby: serving_ruby)
    port = target.info["port"]
    first = Thread.new { get(port, "/debug/pprof/profile?seconds=2") }
    wait_for("the first profile to start") { sampler_thread?(target.pid) }
    busy = get(port, "/debug/pprof/profile?seconds=1")
    expect([busy.code, busy["retry-after"]]).to eq(%w[429 1])
    expect(first.value.code).to eq("200")
    expect(get(port, "/debug/pprof/profile?seconds=61").code).to eq("400")
    expect(get(port, "/debug/pprof/profile?seconds=1&state_leaves=2").code).to eq("400")
    expect(get(port, "/nothing").code).to eq("404")
  end

  describe "starting" do
    before { skip "checked once, on the host's Ruby" unless target_ruby.host? }

    it "names a port in use, refuses an open address without a token, and runs one listener per process" do
      taken = TCPServer.new("127.0.0.1", 0)
      port = taken.addr[1]
      expect { RubySpy::Server.start(port: port) }
        .to raise_error(RubySpy::ListenError, /cannot listen on 127\.0\.0\.1:#{port}: .*in use/i)
      expect { RubySpy::Server.start(bind: "0.0.0.0", port: 0) }.to raise_error(ArgumentError, /without a token/)
      expect { RubySpy::Server.start(port: 70_000) }.to raise_error(ArgumentError, /0 to 65535/)
      expect { RubySpy::Server.start(port: "6060") }.to raise_error(TypeError)
      server = RubySpy::Server.start(port: 0)
      begin
        expect { RubySpy::Server.start(port: 0) }.to raise_error(RubySpy::Error, /already runs .* port #{server.port}/)
        expect(RubySpy::Server.current).to equal(server)
        expect(server.url).to eq("http://127.0.0.1:#{server.port}/debug/pprof/")
      ensure
        server.stop
      end
      expect(server.running?).to be(false)
      expect(RubySpy::Server.current).to be_nil
      expect(ENV.fetch(RubySpy::Server::ENV_SERVED_BY, nil)).to be_nil # children may serve again
    ensure
      taken&.close
    end

    it "starts from RUBYSPY_PPROF at load, once for a process tree, and only warns when the port is taken" do
      port = RubySpyTest::Server.free_port
      script = <<~RUBY
        require "rbspy_ext"
        puts "parent \#{RubySpy::Server.current&.port}"
        child = Process.spawn(RbConfig.ruby, "-I", #{File.join(RubySpyTest::ROOT, "lib").dump}, "-e",
                              'require "rbspy_ext"; puts "child \#{RubySpy::Server.current.inspect}"')
        Process.wait(child)
      RUBY
      out, err, status = Open3.capture3({ "RUBYSPY_PPROF" => "127.0.0.1:#{port}" }, RbConfig.ruby, "-I", File.join(RubySpyTest::ROOT, "lib"), "-e", script)
      expect(status).to be_success, err
      expect(out.lines).to eq(["parent #{port}\n", "child nil\n"])
      expect(err).to eq("")
      taken = TCPServer.new("127.0.0.1", port)
      out, err, status = Open3.capture3({ "RUBYSPY_PPROF" => "127.0.0.1:#{port}" }, RbConfig.ruby, "-I", File.join(RubySpyTest::ROOT, "lib"),
                                        "-e", 'require "rbspy_ext"; puts "booted"')
      expect([status.success?, out]).to eq([true, "booted\n"])
      expect(err).to match(/RUBYSPY_PPROF=127\.0\.0\.1:#{port}: no pprof listener: cannot listen on .*:#{port}/)
    ensure
      taken&.close
    end
  end

  describe "plugin :rubyspy in Puma's cluster mode (workers 2)" do
    before { skip "Puma runs on the host's Ruby here (spec/rails_spec.rb runs it in the chroots)" unless target_ruby.host? }

    def start_cluster
      port = RubySpyTest::Server.free_port
      server = start_server("sinatra_app", env: { "RUBYSPY_WORKERS" => "2", "RUBYSPY_PPROF" => "127.0.0.1:#{port}" })
      [server, port]
    end

    # pid => worker of the samples of `go tool pprof -traces`, and the samples.
    def scrape(port, seconds)
      samples = traces(go_pprof("-traces", "http://127.0.0.1:#{port}/debug/pprof/profile?seconds=#{seconds}&rate=199"))
      [samples.to_h { |s| [s[:labels]["pid"][/\d+/].to_i, s[:labels]["worker"]] }, samples]
    end

    it "records the master and every worker in one scrape, labelled with pid, worker and the route" do
      server, port = start_cluster
      workers, samples = under_load(server, ["/hello/ann"], threads: 4, reconnect: true) { scrape(port, 2) }
      expect(server.workers.size).to eq(2)
      expected = server.workers.to_h { |pid| [pid, File.read("/proc/#{pid}/cmdline")[/cluster worker (\d+):/, 1]] }
      expect(expected.values).to contain_exactly("0", "1")
      expect(workers).to eq(expected.merge(server.pid => "master"))
      greeting = samples.select { |s| s[:functions].include?("Greeter#greet_slowly") }
      expect(greeting.map { |s| s[:labels]["worker"] }.uniq).to contain_exactly("0", "1")
      expect(greeting.map { |s| s[:labels]["endpoint"] }.uniq).to eq(["GET /hello/:name"])
      threads = get(port, "/debug/pprof/threads").body
      expect(threads.scan(/^Process (\d+)/).flatten.map(&:to_i)).to contain_exactly(server.pid, *server.workers)
      expect(threads).to include("(worker 0)", "(worker 1)")
    end

    it "picks up a worker that restarts during a scrape, and workers hold neither the socket nor the listener" do
      server, port = start_cluster
      before = server.workers
      listener = listening_inode(port)
      before.each do |pid|
        expect(socket_inodes(pid)).not_to include(listener)
        names = Dir["/proc/#{pid}/task/*/comm"].map { |f| File.read(f).chomp }
        expect(names.grep(/pprof/)).to eq([])
      end
      killer = Thread.new do
        sleep 1
        Process.kill(:KILL, before.first)
      end
      workers, = under_load(server, ["/hello/ann"], threads: 2, reconnect: true) { scrape(port, 5) }
      killer.join
      replacement = server.workers - before
      expect(replacement.size).to eq(1)
      expect(workers.keys).to include(before.first, before.last, replacement.first)
      expect(workers[replacement.first]).to eq(workers[before.first])
    end
  end

  # The sockets process +pid+ holds, by inode.
  def socket_inodes(pid)
    Dir["/proc/#{pid}/fd/*"].filter_map do |fd|
      File.readlink(fd)[/\Asocket:\[(\d+)\]\z/, 1]
    rescue SystemCallError
      nil
    end
  end

  # The inode of the socket listening on loopback +port+ (/proc/net/tcp: state 0A).
  def listening_inode(port)
    File.readlines("/proc/net/tcp").drop(1).each do |line|
      fields = line.split
      return fields[9] if fields[1].end_with?(format(":%04X", port)) && fields[3] == "0A"
    end
    raise "nothing listens on port #{port}"
  end
end
