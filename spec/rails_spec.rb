# frozen_string_literal: true

require "spec_helper"
require "rbspy_ext"

# The Rails integration (lib/rbspy_ext/rails.rb) in a real Rails app served by a real Puma
# (spec/fixtures/rails_app), recorded from outside as an SRE would: Debian 12's Rails 6.1 and
# Puma 5 on the host's Ruby, or with RUBYSPY_TARGET_RUBY=trixie:inside Debian 13's Rails 7.2
# and Puma 6 on Ruby 3.3 inside that chroot (spec/support/servers.rb).
RSpec.describe "Rails and Puma" do
  # The label of a frame in each action's own work (spec/fixtures/rails_app/config.ru).
  OWN_METHOD = { "orders#show" => "OrdersController#price_order",
                 "invoices#index" => "InvoicesController#total_invoices" }.freeze
  # The name of each of the Puma thread pool's threads, the ones that serve requests (Puma 6
  # names its reaper thread "puma srv tp reap"; Puma 5 "puma srv threadpool reaper").
  POOL_THREAD = /\Apuma srv tp \d{3}\z/

  # Samples whose stack passes through one action's own method, by that method and the
  # endpoint tag the sample carried (nil: none).
  def attribution(profile)
    counts = Hash.new(0)
    profile.group_by(:endpoint).each do |endpoint, part|
      part.stacks.each do |stack|
        OWN_METHOD.each_value do |method|
          counts[[method, endpoint]] += stack[:samples] if stack[:frames].any? { |f| f.label == method }
        end
      end
    end
    counts
  end

  # Every sample inside one action's method carries that action's tag: none another
  # action's, none without an endpoint. (A sample whose stack and tag pointer were not read
  # at one moment, a thread entering the action between the two, is walked again between two
  # readings of the tags: spy/mod.rs, confirm_tags.)
  def expect_every_sample_tagged_with_its_action(profile)
    counts = attribution(profile)
    right = OWN_METHOD.sum { |endpoint, method| counts[[method, endpoint]] }
    untagged = counts.select { |(_, endpoint), _| endpoint.nil? }
    wrong = counts.reject { |(method, endpoint), _| endpoint.nil? || OWN_METHOD[endpoint] == method }
    expect(wrong).to eq({})
    expect(untagged).to eq({})
    OWN_METHOD.each_value { |method| expect(counts.select { |(m, _), _| m == method }.values.sum).to be > 100 }
    expect(right).to be >= 500
    puts "#{right} samples in the actions' own methods, all tagged with their action"
  end

  it "tags every sample inside each action with that action, across 3 Puma threads under concurrent requests" do
    server = start_server("rails_app")
    profile = under_load(server, ["/orders/7", "/invoices"], threads: 6) do
      RubySpy.record(server.pid, rate: 999, duration: 3)
    end
    expect_every_sample_tagged_with_its_action(profile)
    names = profile.threads.map { |t| t[:name].to_s }
    expect(names.grep(POOL_THREAD).size).to eq(3)
    request_ids = profile.tags.filter_map { |set| set[:tags][:request_id] if set[:tags][:endpoint] }
    expect(request_ids.uniq.size).to be > 20 # one per request
  end

  it "tags each worker's actions the same in cluster mode (workers 2), recorded from the master with its children" do
    server = start_server("rails_app", env: { "RUBYSPY_WORKERS" => "2" })
    profile = under_load(server, ["/orders/7", "/invoices"], threads: 6) do
      RubySpy.record(server.pid, rate: 999, duration: 4, subprocesses: true)
    end
    expect_every_sample_tagged_with_its_action(profile)
    busy_pids = profile.threads.select { |t| t[:name].to_s.match?(POOL_THREAD) }.map { |t| t[:pid] }.uniq
    expect(busy_pids.size).to eq(2)
    expect(busy_pids).to match_array(server.workers)
  end

  it "tags a streamed action (ActionController::Live), which Rails runs in a thread of its own" do
    server = start_server("rails_app")
    # 3 s: each streamed request's thread lives ~15 ms, and the recorder re-reads the thread
    # list every 100 ms, so only one request in 5-10 is sampled (over 2 s, 112-201 samples on
    # Rails 7.2 in 10 runs, against the 100 asked for below).
    profile = under_load(server, ["/stream"], threads: 3) { RubySpy.record(server.pid, rate: 999, duration: 3) }
    in_chunks = Hash.new(0)
    profile.group_by(:endpoint).each do |endpoint, part|
      part.stacks.each do |stack|
        in_chunks[endpoint] += stack[:samples] if stack[:frames].any? { |f| f.label == "StreamsController#stream_chunk" }
      end
    end
    # Every sample in the chunks carries the action's tags, though each request's thread is
    # new and may take a dead one's address (spec/tags_spec.rb, short-lived threads).
    expect(in_chunks.keys).to eq(["streams#show"])
    expect(in_chunks["streams#show"]).to be > 100
    ids = profile.tags.filter_map { |set| set[:tags][:request_id] if set[:tags][:endpoint] == "streams#show" }
    expect(ids.uniq.size).to be > 5
    expect(server.get("/stream").body).to match(/\Achunk 0: \d+\nchunk 1: \d+\nchunk 2: \d+\nchunk 3: \d+\n\z/)
  end

  it "tags an ActiveJob performed inline with its class and id, inside the action's tags" do
    server = start_server("rails_app")
    profile = under_load(server, ["/job?ms=20"], threads: 2) { RubySpy.record(server.pid, rate: 999, duration: 2) }
    inside = profile.tagged(:job).stacks.select { |s| s[:frames].any? { |f| f.label == "InvoiceJob#mail_invoice" } }
    expect(inside.sum { |s| s[:samples] }).to be > 100
    outside = profile.stacks.select { |s| s[:frames].any? { |f| f.label == "InvoiceJob#mail_invoice" } }
    expect(outside.sum { |s| s[:samples] }).to eq(inside.sum { |s| s[:samples] }) # none untagged
    sets = profile.tags.map { |set| set[:tags] }.select { |t| t[:job] }
    expect(sets.map { |t| [t[:job], t[:endpoint]] }.uniq).to eq([["InvoiceJob", "jobs#create"]])
    expect(sets.map { |t| t[:job_id] }.uniq.size).to be > 5
    expect(sets.map { |t| t[:job_id] }).to all(match(/\A\h{8}-\h{4}-\h{4}-\h{4}-\h{12}\z/))
  end

  it "ends an action's tags when it raises, adds extra_tags, and leaves nothing for the next request on the thread" do
    server = start_server("rails_app")
    # One connection, so Puma serves these in turn on its threads.
    expect(server.get("/fail").body).to eq("after: endpoint,request_id,tenant\n") # rescue_from is the action's
    expect(server.get("/crash").code).to eq("500") # raised through the Railtie's tags, to Rails' error page
    bodies = Array.new(6) { server.get("/tags", "X-Tenant" => "acme").body }
    bodies.each do |body|
      tags = body.lines.to_h { |l| l.chomp.split("=", 2) }
      expect(tags.keys).to eq(%w[endpoint request_id tenant])
      expect(tags.values_at("endpoint", "tenant")).to eq(%w[tags#show acme])
    end
    expect(bodies.map { |b| b[/request_id=(.*)/, 1] }.uniq.size).to eq(6)
  end

  it "tags nothing with config.rubyspy.tags = false" do
    server = start_server("rails_app", env: { "RUBYSPY_TAGS" => "0" })
    expect(server.get("/tags").body).to eq("\n")
  end

  describe "the pprof endpoint" do
    include RubySpyTest::GoPprof

    # The functions the samples of `go tool pprof -raw` output pass through. (-raw lists
    # every location of the profile after the samples, sampled by the focus or not.)
    def raw_sample_functions(raw)
      samples, locations = raw.split(/^Locations$/, 2)
      # "  7: 0x0 M=1 <top (required)> /usr/bin/puma:25 s=0()": names hold spaces, paths do
      # not, and a C function has none (" :0 s=").
      names = locations.to_s.scan(/^\s+(\d+): 0x\h+ M=\d+ (.*) \S*:-?\d+ s=/).to_h
      ids = samples.lines.grep(/^\s+\d+\s+\d+: [\d ]+$/).flat_map { |line| line.split(":", 2)[1].split }
      expect(ids).not_to be_empty
      ids.uniq.map { |id| names.fetch(id) }.uniq
    end

    it "serves /debug/pprof/allocs under load, naming the allocating action's code (RUBYSPY_ALLOCATIONS=1)" do
      server = start_server("rails_app", env: { "RUBYSPY_TOKEN" => "s3cret", "RUBYSPY_ALLOCATIONS" => "1" })
      url = "http://127.0.0.1:#{server.port}/debug/pprof/allocs?token=s3cret"
      # "flat flat% sum% cum cum% name" of `go tool pprof -top -cum`.
      cum = lambda do |top, name|
        row = top.lines.find { |l| l.rstrip.end_with?(" #{name}") }
        row && Float(row.split[4].delete("%"))
      end
      # Tracking starts at boot, whose allocations (some 60 MB of Rails' own) come first; the
      # actions' share grows with the requests served, which a busy machine serves slowly
      # (2 s gave the catalog 6 % there): asked every 2 s until it leads, for up to a minute.
      top = nil
      under_load(server, ["/catalog", "/hello"], threads: 3) do
        # Every 2 s: some tens of samples at 512 KiB each. The expectations below judge the last.
        # Both judged together: the first look can come with the catalog leading on some
        # 16 samples, none of them yet in the builder (ci-27, 1 run in some 30).
        wait_for("the catalog to lead the allocations", timeout: 60, interval: 2, raise_on_timeout: false) do
          top = go_pprof("-top", "-cum", "-sample_index=alloc_space", url)
          cum.(top, "CatalogController#index").to_f > 30 && cum.(top, "CatalogController#build_catalog").to_f > 1
        end
      end
      expect(top).to include("Type: alloc_space")
      # The catalog action (its JSON the most) holds most of what was allocated, and its
      # builder is there too.
      expect(cum.(top, "CatalogController#index")).to be > 30, top
      expect(cum.(top, "CatalogController#build_catalog")).to be > 1, top
    end

    it "serves a gzipped pprof that go tool pprof reads over HTTP, with the actions' tags as labels" do
      server = start_server("rails_app", env: { "RUBYSPY_TOKEN" => "s3cret" })
      url = "http://127.0.0.1:#{server.port}/debug/pprof/profile?seconds=2&token=s3cret"
      raw = under_load(server, ["/orders/7", "/invoices"], threads: 4) { go_pprof("-raw", url) }
      expect(raw).to include("OrdersController#price_order", "InvoicesController#total_invoices")
      # Top-level frames keep their names (pprof cuts a name at "<" when it equals the system name).
      functions = raw_sample_functions(raw)
      expect(functions).to include("<main>", "<top (required)>")
      expect(functions).not_to include("")
      expect(raw).to match(/endpoint:\[orders#show\]/)
      expect(raw).to match(/thread:\[Thread \d+ \(puma srv tp 00\d\)\]/)
      expect(raw).to match(/state:\[(running|gvl|blocked)\]/)

      focused = under_load(server, ["/orders/7", "/invoices"], threads: 4) do
        go_pprof("-raw", "-tagfocus=endpoint=orders#show", url)
      end
      functions = raw_sample_functions(focused)
      expect(functions).to include("OrdersController#price_order")
      expect(functions).not_to include("InvoicesController#total_invoices")
      expect(focused.scan(/endpoint:\[([^\]]*)\]/).flatten.uniq).to eq(["orders#show"])
    end

    it "go tool pprof -traces -tagfocus=endpoint=orders#show shows only the focused action's stacks" do
      server = start_server("rails_app", env: { "RUBYSPY_TOKEN" => "s3cret" })
      url = "http://127.0.0.1:#{server.port}/debug/pprof/profile?seconds=2&token=s3cret"
      out = under_load(server, ["/orders/7", "/invoices"], threads: 4) do
        go_pprof("-traces", "-tagfocus=endpoint=orders#show", url)
      end
      samples = traces(out)
      # A floor, not a rate: distinct traces of 2 s under 4 clients (20 were seen with two
      # lanes of CI beside it, which asked for more than 20).
      expect(samples.size).to be >= 10
      expect(samples.map { |s| s[:labels]["endpoint"] }.uniq).to eq(["orders#show"])
      expect(samples.map { |s| s[:labels]["thread"] }).to all(match(/\AThread \d+ \(puma srv tp 00\d\)\z/))
      functions = samples.flat_map { |s| s[:functions] }.uniq
      expect(functions).to include("OrdersController#price_order", "OrdersController#show")
      expect(functions.grep(/InvoicesController/)).to eq([])
    end

    # Rails 7.1 and later generate production configs with config.force_ssl = true, which
    # sends plain HTTP to https, a mounted Rack app included; the app excludes the endpoint
    # with config.ssl_options, as docs/fleets.md tells users to. The other examples talk to the
    # app's routes as a TLS-terminating proxy would (RubySpyTest::Server::PROXY_HEADERS).
    it "answers plain HTTP under production's force_ssl, which redirects the app's own routes (Rails 7.2)" do
      server = start_server("rails_app")
      version = server.rails_version
      skip "Rails #{version} generates production.rb with force_ssl off" if version < Gem::Version.new("7.1")

      plain = server.get("/orders/7", proxied: false)
      expect([plain.code, plain["location"]]).to eq(["301", "https://127.0.0.1:#{server.port}/orders/7"])
      expect(server.get("/orders/7").code).to eq("200")
      index = server.get("/debug/pprof/", proxied: false)
      expect(index.code).to eq("200")
      expect(index.body).to include("/debug/pprof/profile?seconds=N")
    end

    it "serves from each Puma worker a profile of that worker alone in cluster mode (workers 2)" do
      server = start_server("rails_app", env: { "RUBYSPY_TOKEN" => "s3cret", "RUBYSPY_WORKERS" => "2" })
      url = "http://127.0.0.1:#{server.port}/debug/pprof/profile?seconds=2&token=s3cret"
      raw = under_load(server, ["/orders/7", "/invoices"], threads: 4, reconnect: true) { go_pprof("-raw", url) }
      pids = raw.scan(/pid:\[(\d+)\]/).flatten.map(&:to_i).uniq
      expect(pids.size).to eq(1)
      expect(server.workers).to include(pids.first)
      expect(raw_sample_functions(raw)).to include("OrdersController#price_order", "InvoicesController#total_invoices")
    end

    it "refuses a wrong token (403), a second profile while one runs (429), bad seconds and unknown parameters (400)" do
      server = start_server("rails_app", env: { "RUBYSPY_TOKEN" => "s3cret" })
      base = "/debug/pprof/profile"
      expect(server.get("#{base}?seconds=1&token=wrong").code).to eq("403")
      expect(server.get("#{base}?seconds=1", "Authorization" => "Bearer wrong").code).to eq("403")
      expect(server.get("#{base}?seconds=1", "Authorization" => "Bearer s3cret").code).to eq("200")
      %w[0 61 abc 1.5 -1].each do |bad|
        response = server.get("#{base}?seconds=#{bad}")
        expect([bad, response.code, response.body]).to eq([bad, "400", "seconds must be a whole number from 1 to 60\n"])
      end
      expect(server.get("#{base}?seconds=1&rate=5000").code).to eq("400")
      expect(server.get("#{base}?seconds=1&debug=1").code).to eq("400")

      first = Thread.new do
        started = Process.clock_gettime(Process::CLOCK_MONOTONIC)
        [server.get("#{base}?seconds=2"), Process.clock_gettime(Process::CLOCK_MONOTONIC) - started]
      end
      wait_for("the first profile to start") { sampler_thread?(server.pid) }
      busy = server.get("#{base}?seconds=1")
      expect([busy.code, busy["retry-after"]]).to eq(%w[429 1])
      response, elapsed = first.value
      expect(response.code).to eq("200")
      expect(elapsed).to be < 3.0 # never holds a Puma thread longer than seconds + 1
      expect(server.get("/debug/pprof/").body).to include("/debug/pprof/profile?seconds=N")
    end
  end

  # The listener of its own (RubySpy::Server) in Puma's master (plugin :rubyspy, from
  # RUBYSPY_PPROF in spec/fixtures/puma.rb): no route, so no force_ssl exclusion is needed.
  describe "the pprof listener in Puma's cluster mode (workers 2)" do
    include RubySpyTest::GoPprof

    it "serves one scrape of the master and both workers with the actions' tags, and -tagfocus keeps one action" do
      listen = RubySpyTest::Server.free_port
      server = start_server("rails_app", env: { "RUBYSPY_WORKERS" => "2", "RUBYSPY_PPROF" => "127.0.0.1:#{listen}" })
      url = "http://127.0.0.1:#{listen}/debug/pprof/profile?seconds=3&rate=199"
      samples = under_load(server, ["/orders/7", "/invoices"], threads: 4, reconnect: true) { traces(go_pprof("-traces", url)) }
      workers = samples.to_h { |s| [s[:labels]["pid"][/\d+/].to_i, s[:labels]["worker"]] }
      expect(server.workers.size).to eq(2)
      expect(workers.keys).to contain_exactly(server.pid, *server.workers)
      expect(workers[server.pid]).to eq("master")
      expect(workers.values_at(*server.workers)).to contain_exactly("0", "1")
      OWN_METHOD.each do |endpoint, method|
        inside = samples.select { |s| s[:functions].include?(method) }
        expect(inside.map { |s| s[:labels]["endpoint"] }.uniq).to eq([endpoint])
        expect(inside.map { |s| s[:labels]["worker"] }.uniq).to contain_exactly("0", "1")
      end

      focused = under_load(server, ["/orders/7", "/invoices"], threads: 4, reconnect: true) do
        traces(go_pprof("-traces", "-tagfocus=endpoint=orders#show", url))
      end
      expect(focused.size).to be > 10
      expect(focused.map { |s| s[:labels]["endpoint"] }.uniq).to eq(["orders#show"])
      expect(focused.flat_map { |s| s[:functions] }.uniq).to include("OrdersController#price_order")
      expect(focused.flat_map { |s| s[:functions] }.grep(/InvoicesController/)).to eq([])
      plain = Net::HTTP.get_response(URI("http://127.0.0.1:#{listen}/debug/pprof/"))
      expect([plain.code, plain.body]).to match(["200", /profiles of process #{server.pid}/])
    end
  end
end
