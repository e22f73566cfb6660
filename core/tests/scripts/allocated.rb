# Allocates 100,000 objects, writes its own count of objects allocated
# (GC.stat(:total_allocated_objects)) to ARGV[0], then parks: the count read from outside
# is that one plus what writing the file allocated.
kept = Array.new(100_000) { Object.new }
count = GC.stat(:total_allocated_objects)
File.write("#{ARGV[0]}.tmp", count.to_s)
File.rename("#{ARGV[0]}.tmp", ARGV[0])
sleep
kept
