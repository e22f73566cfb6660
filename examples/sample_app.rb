# frozen_string_literal: true

# A small program to point RubySpy at: it alternates CPU-bound work inside nested classes and
# blocks with short sleeps, forever (until killed). Usage:
#   ruby examples/sample_app.rb [READY_FILE]
# READY_FILE, when given, is written with the pid once the program is running, so callers
# can wait for it instead of guessing.

module Shop
  class Inventory
    class Report
      def initialize(items)
        @items = items
      end

      # Nested blocks on purpose: map over each_slice -> block -> sum block -> checksum -> reduce block
      def totals
        @items.each_slice(10).map do |slice|
          slice.sum { |item| checksum(item) }
        end
      end

      private

      def checksum(item)
        (1..30_000).reduce(item) { |acc, n| (acc * 31 + n) % 1_000_003 }
      end
    end

    def self.pause
      sleep 0.2
    end
  end
end

File.write(ARGV[0], Process.pid.to_s) if ARGV[0]
loop do
  Shop::Inventory::Report.new((1..100).to_a).totals
  Shop::Inventory.pause
end
